"""Ablations of the Hopper backward: copies of ``flashtune/kernels/attn_bwd_hopper.py`` with
one part of the work removed, to time beside the real kernel (``hopper_bwd_ab.py``) and
see what each part costs at head dim 128. Their gradients are wrong by design: never
``--check`` them, never ship them.

- ``noexp``: Pᵀ is the exponent itself (no ``exp2``): the exponentials' cost.
- ``noreduce``: the dQ staging buffers are never added to global memory (the TMA
  reduce-add is not issued; staging stores, hand-offs and turns stay): the L2 reduce-adds.
- ``noturn``: the fixed order's dQ writers add without waiting for their turn (the
  semaphore is still passed on): what the fixed order costs over an unordered one.
- ``nostage``: ``noreduce``, and dQ's product is not stored to the staging buffers either
  (computed and waited for; fences, barriers and hand-offs stay): the staging stores.
  Check an ablated copy's sm_90 SASS before reading a time off it (``bwd_spills.py
  --module``, then ptxas and nvdisasm): a guard the compiler can fold takes the product
  with it (see ``_NEVER``).
- ``nodkdv``: dK and dV not stored at the end of a head (computed and waited for): the
  epilogue's stores from registers.
- ``nodq``: no dQ at all (no product, staging, hand-off or writer work; dS still goes to
  shared memory and the fixed order's consumers still meet on it): dQ's whole cost.

Every edit changes what ptxas allocates, so a difference is an estimate of a part's cost,
not an exact one. Writes one module per ablation into ``--dir`` and prints
``name=path`` arguments for ``hopper_bwd_ab.py --variant``:

    python3 benchmarks/experiments/bwd_ablate.py --dir .stage_ablate
"""

from __future__ import annotations

import argparse
import os

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "flashtune",
                   "kernels", "attn_bwd_hopper.py")


def _one(text: str, old: str, new: str, what: str) -> str:
    n = text.count(old)
    if n != 1:
        raise SystemExit(f"{what}: expected the anchor once, found it {n} times: {old[:60]!r}")
    return text.replace(old, new)


def _cut(text: str, start: str, end: str, new: str, what: str, within: str | None = None) -> str:
    """Replace the text from ``start`` up to and including ``end`` (the first ``end`` after
    it) by ``new``; with ``within``, only inside the function that begins there."""
    lo = 0
    hi = len(text)
    if within is not None:
        lo = text.index(within)
        nxt = text.find("\n@gluon.jit", lo + 1)
        hi = nxt if nxt >= 0 else len(text)
    seg = text[lo:hi]
    if seg.count(start) != 1:
        raise SystemExit(f"{what}: expected the start anchor once, found {seg.count(start)}")
    a = seg.index(start)
    b = seg.index(end, a) + len(end)
    return text[:lo] + seg[:a] + new + seg[b:] + text[hi:]


def noexp(t: str) -> str:
    return _one(t, "p_t = gl.exp2(s_t * qk_scale - lse2[None, :])",
                "p_t = s_t * qk_scale - lse2[None, :]", "noexp")


def noreduce(t: str) -> str:
    return _one(t, "    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, "
                   "desc.handle, coord,\n                                              src.handle)",
                "    pass", "noreduce")


def noturn(t: str) -> str:
    return _one(t, "            while gl.atomic_add(sem, 0, sem=\"acquire\") != turn:\n"
                   "                pass\n", "", "noturn")


def nodq(t: str) -> str:
    # The deferred path (_dq_stage): meet on dS, free its slot, nothing else.
    t = _cut(t, "    base = slot * CONSUMERS\n",
             "mbarrier.arrive(dq_full.index(cid * DQ_RING + r % DQ_RING), count=1)\n",
             "    mbarrier.arrive(ds_free.index(slot), count=1)\n", "nodq/_dq_stage",
             within="def _dq_stage(")
    # The fixed order without deferral (LEAN at D=128: dK/dV already waited for).
    t = _cut(t, "                    dq = _dq_chunk(ds_smem, 0, ds_buf, k_smem, cid, 0,",
             "mbarrier.arrive(dq_full.index(cid * DQ_RING + slot), count=1)\n",
             "                    gl.static_assert(LEAN)\n"
             "                    if SPLIT_D:\n"
             "                        mbarrier.arrive(ds_free.index(0), count=1)\n",
             "nodq/fixed", within="def _bwd_consumer(")
    # The free order (LEAN at D=128).
    t = _cut(t, "                    dq = warpgroup_mma(ds_buf.permute((1, 0)), k,",
             "[1, 1, BLOCK_M, D],\n" + " " * 60 + "desc_dq.layout))\n",
             "                    gl.static_assert(LEAN)\n", "nodq/free (both layouts)",
             within="def _bwd_consumer(")
    # The writers: walk, but add nothing and wait for nothing.
    return _cut(t, "            sem, turn = _dq_turn(",
                "gl.atomic_xchg(sem, turn + 1, sem=\"release\")\n",
                "", "nodq/writer", within="def _bwd_dq_writer(")


# The guard of ``nostage``'s stores: a condition that never holds (the grid has one layer in
# z) and that the compiler cannot prove false. Session 48's guard, a tile count ``< 0``, it
# could (a count from 0 that only grows), and so can it ``> 1 << 30`` (the trip count is
# at most an int32 over BLOCK_M): LLVM dropped the stores, ptxas then the dQ product they
# alone used (sm_90 SASS: 32 HGMMA.64x64x16 instead of 64), and ``nostage`` timed the
# kernel without dQ's product.
_NEVER = "gl.program_id(2) == 7"


def nostage(t: str) -> str:
    """noreduce, and dQ's product is computed and waited for but not stored to the staging
    buffers (the stores sit behind a condition that never holds and that the compiler
    cannot prove never holds, so the product stays: see ``_NEVER``); fences, barriers and
    hand-offs stay. Every dQ layout (rows, column groups, register order) is cut alike."""
    t = noreduce(t)
    for what, indent, dst in (
            ("nostage/_dq_stage", 8, "dq_smem.index(cid * DQ_RING + r % DQ_RING)"),
            ("nostage/fixed", 24, "dq_smem.index(cid * DQ_RING + slot)")):
        sp = " " * indent
        stores = (f"{sp}if DQ_LAYOUT == 2:\n{sp}    {dst}.store(_fragments(dq))\n"
                  f"{sp}elif DQ_LAYOUT == 1:\n{sp}    {dst}.store(_grouped(dq))\n"
                  f"{sp}else:\n{sp}    {dst}.store(dq)\n")
        guarded = f"{sp}if {_NEVER}:\n" + "".join(
            f"    {line}\n" for line in stores.splitlines())
        t = _one(t, stores, guarded, what)
    sp = " " * 24
    for what, store in (("nostage/free frag", "dq_buf.store(_fragments(dq))"),
                        ("nostage/free", "dq_buf.store(dq)")):
        t = _one(t, f"{sp}{store}\n", f"{sp}if {_NEVER}:\n{sp}    {store}\n", what)
    return t


def nodkdv(t: str) -> str:
    """dK and dV computed and waited for but not stored at the end of a head (the register
    stores, ``hopper_dkdv_tma=0``, sit behind ``_NEVER``): what those stores cost."""
    for what, name in (("nodkdv/dk", "DK"), ("nodkdv/dv", "DV")):
        at = t.index(f"gl.store({name} + b64 * ")
        a = t.rindex("\n", 0, at) + 1
        b = t.index("mask=ok)\n", at) + len("mask=ok)\n")
        block = t[a:b]
        if t.count(block) != 1:
            raise SystemExit(f"{what}: expected the store once")
        sp = " " * (at - a)
        guarded = f"{sp}if {_NEVER}:\n" + "".join(f"    {line}\n" for line in
                                                  block.splitlines())
        t = t[:a] + guarded + t[b:]
    return t


ABLATIONS = {"noexp": noexp, "noreduce": noreduce, "noturn": noturn, "nodq": nodq,
             "nostage": nostage, "nodkdv": nodkdv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where to write the module copies")
    ap.add_argument("--only", default=",".join(ABLATIONS), help="comma-separated ablations")
    args = ap.parse_args()
    with open(SRC) as f:
        head = f.read()
    os.makedirs(args.dir, exist_ok=True)
    specs = []
    for name in args.only.split(","):
        path = os.path.join(args.dir, f"attn_bwd_hopper_{name}.py")
        with open(path, "w") as f:
            f.write(ABLATIONS[name](head))
        specs.append(f"--variant {name}={path}")
    print(" ".join(specs))


if __name__ == "__main__":
    main()
