"""``hopper_dq_store_first`` without a branch in the dQ writer: a copy of
``flashtune/kernels/attn_bwd_hopper.py`` for an A/B on an sm90 GPU.

Why: with the knob the writer picks, per query tile, a TMA store (its first turn) or a TMA
reduce-add (every later one) with ``if turn == 0``, and waits for the stores to complete
under another ``if``. Built for sm_90 with Triton 3.6 (``bwd_spills.py --frag`` on a copy
with the knob forced on), that runtime branch alone grows consumer 0's spills, in another
partition: 0/0 -> 32/40 bytes of spill stores/loads per thread at 4x32/8x4096x128,
116/120 -> 248/300 causal, 0/0 -> 36/36 with three stages. Always storing (no branch, wrong
sums) builds with the tree's spills; so does a branch-free form of the same choice, which
this copy writes:

- each chunk issues both ops, the store and the reduce-add, and the one that is not this
  turn's gets a box coordinate 2^24 blocks past the accumulator (``gl.where``, a select):
  TMA writes nothing out of bounds;
- the completion wait is one inline PTX block whose ``cp.async.bulk.wait_group 0`` and
  ``fence.proxy.async.global`` are predicated on ``turn == 0`` (``setp`` inside the asm).

Spills of the copy, knob on (session 51, CPU): 0/0, 116/120 causal, 0/0 three stages, 0/0,
0/0, 40/88, 56/56 (tree 72/120), 28/72, 4/4 at ``bwd_spills.py``'s nine cases: the tree's
or fewer. Session 51's GPU A/B put the always-on knob (with the branch) at 0.77-1.00x the
kernel from 1k keys at D=128, and a copy without the completion wait timed the same, so
the spills are the suspect. What this copy costs on a GPU is not known: it issues twice the
TMA ops per chunk (does an out-of-bounds box still read its shared-memory source?). Not
run on a GPU.

    python3 benchmarks/experiments/bwd_store_first_nobranch.py --dir D   # prints a --variant
    PYTHONPATH=<triton 3.6>:<tree>:<tree>/benchmarks python3 \\
        benchmarks/experiments/bwd_spills.py --frag --module D/attn_bwd_hopper_sfnb.py
    timeout 500 python3 benchmarks/experiments/bwd_shipped_variants.py --variant head \\
        --variant sf= --variant sfnb=D/attn_bwd_hopper_sfnb.py \\
        --knobs 'sf={"hopper_dq_store_first": 1}' --knobs 'sfnb={"hopper_dq_store_first": 1}' \\
        --det-only sf,sfnb --shapes 0-11 --out ab.json

(``bwd_spills.py`` builds the shipped-style configs without the knob: for the spills of the
knob's code, build a copy whose ``HopperBwdLaunch`` sets ``store_first`` whenever frag and
the fixed order are on, as ``--force`` writes.)
"""

from __future__ import annotations

import argparse
import os

from bwd_ablate import _one  # (this folder is the script's sys.path[0])

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "flashtune",
                   "kernels", "attn_bwd_hopper.py")

BRANCH = """                        if turn == 0:
                            tma.async_copy_shared_to_global(
                                desc_dq, [b * heads_q + h, block, 0, 0], src)
                        else:
                            _tma_reduce_add(desc_dq, [b * heads_q + h, block, 0, 0], src)
"""
SELECT = """                        # No branch (it grows consumer 0's spills): the op that is not
                        # this turn's gets a box past the accumulator, where TMA writes nothing.
                        first = turn == 0
                        tma.async_copy_shared_to_global(
                            desc_dq, [b * heads_q + h, gl.where(first, block, block + PAST), 0, 0],
                            src)
                        _tma_reduce_add(
                            desc_dq, [b * heads_q + h, gl.where(first, block + PAST, block), 0, 0],
                            src)
"""
WAIT = """            if STORE_FIRST:
                if turn == 0:
                    # The next turn's reduce-adds must find the stores done, not only
                    # their sources read: wait for the writes themselves.
                    _bulk_writes_done()
"""
WAIT_PRED = """            if STORE_FIRST:
                _bulk_writes_done_if_first(turn)
"""
HELPER_AT = """@gluon.jit
def _bwd_producer("""
HELPER = '''PAST: gl.constexpr = gl.constexpr(1 << 24)  # blocks past any accumulator


@gluon.jit
def _bulk_writes_done_if_first(turn):
    """_bulk_writes_done, predicated on ``turn == 0`` inside the PTX (no branch)."""
    lane: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.inline_asm_elementwise(
        "{\\n\\t.reg .pred p;\\n\\tsetp.eq.s32 p, $1, 0;\\n\\t@p cp.async.bulk.wait_group 0;"
        "\\n\\t@p fence.proxy.async.global;\\n\\tmov.b32 $0, 0;\\n\\t}", "=r,r",
        [gl.full([32], 0, gl.int32, lane) + turn], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bwd_producer('''
FORCE = "store_first = bool(c.hopper_dq_store_first) and self.frag and deterministic"


def transform(text: str, force: bool = False) -> str:
    text = _one(text, BRANCH, SELECT, "the writer's branch")
    text = _one(text, WAIT, WAIT_PRED, "the completion wait")
    text = _one(text, HELPER_AT, HELPER, "the helper")
    if force:  # the knob on wherever frag and the fixed order are (for bwd_spills.py)
        text = _one(text, FORCE, "store_first = self.frag and deterministic", "--force")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where to write the module copy")
    ap.add_argument("--force", action="store_true",
                    help="also write attn_bwd_hopper_sfnb_forced.py, the knob always on")
    args = ap.parse_args()
    with open(SRC) as f:
        head = f.read()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "attn_bwd_hopper_sfnb.py")
    with open(path, "w") as f:
        f.write(transform(head))
    if args.force:
        with open(os.path.join(args.dir, "attn_bwd_hopper_sfnb_forced.py"), "w") as f:
            f.write(transform(head, force=True))
    print(f"--variant sfnb={path}")


if __name__ == "__main__":
    main()
