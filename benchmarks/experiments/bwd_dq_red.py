"""The free order's dQ added from registers: copies of ``flashtune/kernels/attn_bwd_hopper.py``
whose free order with ``hopper_dq_frag`` adds each consumer's fp32 dQ tile to the
accumulator with global reductions (inline PTX or ``gl.atomic_add``, relaxed) instead of
staging it in shared memory for one TMA reduce-add.

Why: session 50's ablation (``bwd_ablate.py``, ``nostage`` with the product kept; its free
order ran with dQ staged in rows, frag off) took the free order from 0.83-0.85x to
1.11-1.17x cuDNN at head dim 128 by leaving out the staging stores, while leaving out only
the reduce-adds gained nothing. Staging means a 32 KB burst of stores per consumer and
query tile into a single buffer that the previous tile's reduce-add must have read first.
Added from registers, each thread's values go straight to L2, in the accumulator's register
order (``_fragments``): a thread's four values (rows r and r + 8, columns c and c + 1) are
contiguous there, so the adds are 16-byte vector reductions. ``redv4`` writes them in
inline PTX (``red.global.add.v4.f32``); ``atomic`` leaves them to ``gl.atomic_add`` on the
tile in _fragments' layout, which Triton 3.6 lowers to
``atom.global.gpu.relaxed.add.v4.f32``; ``redv4c`` and ``atomicc`` compute dQ in two column
halves and add each as soon as it is done (half the accumulator registers live).
``--show`` builds the tree's kernel and the copies for sm_90 on the CPU and prints their
reductions and spills (at 4x16x4096x128, free order, frag: 20/32 bytes of spill
stores/loads in the tree's kernel, 84/100, 92/108, 4/8 and 0/0 in the copies; at D=64
with 128-row tiles the tree's 0-8 against 48-64 / 76-116 in the chunked copies).
On the H200 (session 51, BENCHMARKS.md) ``atomicc`` and ``redv4c`` pass the correctness
grid, and every copy runs 10-30% slower than the staged kernel (free order with frag,
four shapes at D=128 and D=64): not adopted.

The free order's gradients are not bit-reproducible either way; ``hopper_bwd_ab.py
--check`` compares them with the fp32 reference. The accumulator is the free order's
(``HopperBwdLaunch`` passes it as ``Sem`` there), so the host code is unchanged.

    python3 benchmarks/experiments/bwd_dq_red.py --dir D --ab out.json --check atomicc,redv4c
    python3 benchmarks/experiments/bwd_dq_red.py --dir D   # prints hopper_bwd_ab --variant args
    PYTHONPATH=<triton 3.6>:<tree>:<tree>/benchmarks python3 \\
        benchmarks/experiments/bwd_dq_red.py --dir D --show
"""

from __future__ import annotations

import argparse
import os
import re

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "flashtune",
                   "kernels", "attn_bwd_hopper.py")

RED = '''

@gluon.jit
def _dq_red(Acc, dq, block, BLOCK_M: gl.constexpr, N: gl.constexpr, layout: gl.constexpr,
            V4: gl.constexpr, COL0: gl.constexpr = 0):
    """Add a [BLOCK_M, N] dQ tile (wgmma accumulator ``layout``) into its block of the
    register-order accumulator (see _fragments) with global reductions: row
    64 blk + 16 w + 8 h + a and column 8 j + 2 e' + e sit at
    64 N blk + 512 j + 128 w + 16 a + 4 e' + 2 h + e. With V4, one 16-byte
    ``red.global.add.v4.f32`` per four values (a thread's registers 4k..4k+3 are rows
    r, r + 8 and columns c, c + 1: contiguous there) in inline PTX; else ``gl.atomic_add``
    on the tile in _fragments' layout, which Triton 3.6 vectorizes the same way. A tile of
    fewer columns than N holds columns COL0.. of the block."""
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    c = COL0 + gl.arange(0, dq.shape[1], layout=gl.SliceLayout(0, layout))
    row_at = (r // 64) * (64 * N) + ((r // 16) % 4) * 128 + (r % 8) * 16 + ((r // 8) % 2) * 2
    col_at = (c // 8) * 512 + ((c % 8) // 2) * 4 + c % 2
    if V4:
        # A 64-bit pointer per value, only every fourth one read: the compiler spills less
        # with them (84/100 bytes of spill stores/loads per thread, the tree's kernel 20/32)
        # than with a 64-bit base and 32-bit offsets (188/248).
        ptrs = Acc + block * (BLOCK_M * N) + row_at[:, None] + col_at[None, :]
        gl.inline_asm_elementwise(
            "red.global.add.v4.f32 [$4], {$8, $9, $10, $11};\\n\\t"
            "mov.b32 $0, 0;\\n\\tmov.b32 $1, 0;\\n\\tmov.b32 $2, 0;\\n\\tmov.b32 $3, 0;",
            "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [ptrs.to(gl.int64, bitcast=True), dq],
            dtype=gl.int32, is_pure=False, pack=4)
    else:
        # In _fragments' layout Triton sees each thread's four contiguous values and emits
        # one atom.global.add.v4.f32 per four (92/108 bytes of spills for a whole tile). A
        # tile of W columns lays its column octet j' (two rows of 256) of 64-row block blk
        # at row blk W / 4 + 2 j' + w // 2; in the block it belongs at
        # blk N / 4 + 2 (j' + COL0 / 8) + w // 2.
        W: gl.constexpr = dq.shape[1]
        x = _fragments(dq)
        i = gl.arange(0, BLOCK_M * W // 256, layout=gl.SliceLayout(1, x.type.layout))
        e = gl.arange(0, 256, layout=gl.SliceLayout(0, x.type.layout))
        rows = (i // (W // 4)) * (N // 4) + COL0 // 4 + i % (W // 4)
        gl.atomic_add(Acc + block * (BLOCK_M * N) + rows[:, None] * 256 + e[None, :], x,
                      sem="relaxed")


@gluon.jit
def _bwd_consumer('''

STAGED = '''                    if DQ_LAYOUT == 2:
                        dq_buf.store(_fragments(dq))
                        fence_async_shared()
                        gl.thread_barrier()
                        _tma_reduce_add(desc_dq,
                                        [b * heads_q + hk * GQA + g, start // BLOCK_M, 0, 0],
                                        dq_buf._reinterpret(gl.float32,
                                                            [1, 1, BLOCK_M * D // 256, 256],
                                                            desc_dq.layout))
'''

REDUCED = '''                    if DQ_LAYOUT == 2:
                        _dq_red(Sem, dq, (b * heads_q + hk * GQA + g).to(gl.int64) * n_m
                                + start // BLOCK_M, BLOCK_M, D, dq_layout, V4)
'''


# The free order's product and hand-off, from the product on (the chunked form replaces both).
FREE = '''                else:
                    dq = warpgroup_mma(ds_buf.permute((1, 0)), k,
'''

CHUNKED = '''                elif DQ_LAYOUT == 2:
                    # dQ in two column halves, each added as soon as it is done: half the
                    # accumulator registers live at a time (no overlap between the halves).
                    half: gl.constexpr = gl.NVMMADistributedLayout(
                        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
                    blk = (b * heads_q + hk * GQA + g).to(gl.int64) * n_m + start // BLOCK_M
                    for hh in gl.static_range(2):
                        dq = warpgroup_mma(ds_buf.permute((1, 0)),
                                           k.slice(hh * (D // 2), D // 2, dim=1),
                                           gl.zeros([BLOCK_M, D // 2], gl.float32, layout=half),
                                           use_acc=False, is_async=True)
                        if LEAN or hh == 1:
                            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
                        else:
                            dq, dk, dv = warpgroup_mma_wait(num_outstanding=0,
                                                            deps=(dq, dk, dv))
                            mbarrier.arrive(q_empty.index(buf), count=1)
                            mbarrier.arrive(do_empty.index(buf), count=1)
                        _dq_red(Sem, dq, blk, BLOCK_M, D, half, V4, hh * (D // 2))
''' + FREE


def _one(text: str, old: str, new: str, what: str) -> str:
    n = text.count(old)
    if n != 1:
        raise SystemExit(f"{what}: expected the anchor once, found it {n} times: {old[:60]!r}")
    return text.replace(old, new)


def transform(t: str, v4: bool, chunked: bool = False) -> str:
    # The consumers get the kernel's Sem (the free order's accumulator) after DV.
    n = t.count("dq_empty, LSE, Delta, desc_dq, DK, DV,")
    if n < 2:
        raise SystemExit(f"consumer arguments: found the anchor {n} times")
    t = t.replace("dq_empty, LSE, Delta, desc_dq, DK, DV,",
                  "dq_empty, LSE, Delta, desc_dq, DK, DV, Sem,")
    t = _one(t, "\n\n@gluon.jit\ndef _bwd_consumer(", RED, "_dq_red")
    t = _one(t, STAGED, REDUCED.replace("V4)", f"{v4})"), "free-order staging")
    return (_one(t, FREE, CHUNKED.replace("V4,", f"{v4},"), "free-order product") if chunked
            else t)


def show(path: str) -> None:
    """Build the copy's free order with frag (4x16x4096x128) for sm_90 and print the PTX's
    global reduction and atomic instructions, counted by kind."""
    import collections

    import torch
    from bwd_spills import ptxas_report, use_module
    from probe_ptxas import BUILT_PTX

    from flashtune.kernels.attn_bwd import bwd_steps
    from flashtune.kernels.config import BWD_HOPPER, BwdConfig
    from flashtune.problem import default_scale

    use_module(path)
    q, do, o = (torch.empty(4, 16, 4096, 128, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.empty(4, 16, 4096, 128, dtype=torch.bfloat16) for _ in range(2))
    cfg = BwdConfig(variant=BWD_HOPPER, hopper_block_m=64, hopper_block_n=128, hopper_stages=2,
                    hopper_regs=240, hopper_dq_frag=1)
    BUILT_PTX.clear()
    _, steps = bwd_steps(do, q, k, v, o, torch.empty(4, 16, 4096), causal=False,
                         sm_scale=default_scale(128), window=(-1, -1), softcap=0.0, config=cfg,
                         deterministic=False)
    for _, step in steps:
        step()
    ptx = BUILT_PTX["_attn_bwd_hopper_kernel"]
    kinds = collections.Counter(re.findall(r"\b((?:red|atom)\.[a-z0-9.:_]+)", ptx))
    for kind, count in sorted(kinds.items()):
        print(f"{count:5d} {kind}")
    print(ptxas_report(ptx))


def ab(paths: dict[str, str], shapes: list[int], rounds: int, check: list[str],
       out_path: str) -> None:
    """On an sm_90 GPU: ``hopper_bwd_ab.check`` of the named copies with
    ``hopper_dq_frag`` on in every config (free and fixed order against the fp32
    reference, the fixed order bit for bit), then per shape one interleaved timing
    (``flashtune.timing.time_interleaved``) of cuDNN's backward and the free order with
    frag at tiles 64x128 (128x128 at D=64), two stages, in the tree's kernel and in each
    copy; the copies' gradients are compared with the tree's (max abs difference)."""
    import dataclasses
    import json
    import time

    import hopper_bwd_ab as hab
    import torch

    from flashtune.kernels.config import BWD_HOPPER, BwdConfig
    from flashtune.timing import time_interleaved

    mods = {"head": hab.head_mod, **{n: hab.load(n, p) for n, p in paths.items()}}
    out: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                     date=time.strftime("%Y-%m-%d"), check={}, bench=[])
    try:
        plain = hab.hopper_cfg
        hab.hopper_cfg = lambda m, n, st: dataclasses.replace(plain(m, n, st), hopper_dq_frag=1)
        for name in check:
            rows: list = []
            t0 = time.time()
            ok = hab.check(mods[name], rows)
            out["check"][name] = dict(ok=ok, rows=rows, seconds=time.time() - t0)
            print(f"check {name} (frag): {'all OK' if ok else 'FAILED'} ({len(rows)} cases, "
                  f"{time.time() - t0:.0f} s)", flush=True)
        hab.hopper_cfg = plain
        for i in shapes:
            shape = hab.SHAPES[i]
            d, causal = shape[3], shape[4]
            fns, (do, q, k, v, o, lse), _, scale = hab.shape_inputs(shape)
            cfg = BwdConfig(variant=BWD_HOPPER, hopper_block_m=64 if d == 128 else 128,
                            hopper_block_n=128, hopper_stages=2, hopper_dq_frag=1)
            grads = {}
            for name, mod in mods.items():
                grads[name], fns[name] = hab.prepared(mod, do, q, k, v, o, lse, cfg, causal,
                                                      (-1, -1), 0.0, scale, False)
                fns[name]()
                torch.cuda.synchronize()
                grads[name] = tuple(g.clone() for g in grads[name])
            diff = {n: max(float((a.float() - b.float()).abs().max())
                           for a, b in zip(grads[n], grads["head"], strict=True))
                    for n in grads if n != "head"}
            names = list(fns)
            ms = {n: t.median_ms for n, t in zip(
                names, time_interleaved([fns[n] for n in names], rounds=rounds), strict=True)}
            out["bench"].append(dict(shape=list(shape), config=repr(cfg), ms=ms,
                                     max_abs_diff_vs_head=diff))
            print(f"{shape} cudnn {ms['cudnn']:.3f} ms | cudnn/x: " + " ".join(
                f"{n}={ms['cudnn'] / ms[n]:.3f}" for n in names if n != "cudnn")
                + f" | max |grad - head's| {diff}", flush=True)
    finally:
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where to write the module copies")
    ap.add_argument("--show", action="store_true",
                    help="build them for sm_90 (compile-only, Triton 3.6) and count their "
                         "reductions")
    ap.add_argument("--ab", default=None, metavar="OUT.json",
                    help="on a GPU: check and time them (see ab) into OUT.json")
    ap.add_argument("--check", default="", help="copies to check with --ab (comma-separated)")
    ap.add_argument("--shapes", default="7,10,8", help="indices into hopper_bwd_ab.SHAPES")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with open(SRC) as f:
        head = f.read()
    os.makedirs(args.dir, exist_ok=True)
    paths = {}
    if args.show:
        print("head (the tree's kernel)")
        show(SRC)
    for name, v4, chunked in (("redv4", True, False), ("atomic", False, False),
                              ("redv4c", True, True), ("atomicc", False, True)):
        paths[name] = os.path.join(args.dir, f"attn_bwd_hopper_{name}.py")
        with open(paths[name], "w") as f:
            f.write(transform(head, v4, chunked))
        if args.show:
            print(name)
            show(paths[name])
    if args.ab:
        ab(paths, [int(i) for i in args.shapes.split(",") if i],
           args.rounds, [c for c in args.check.split(",") if c], args.ab)
    elif not args.show:
        print(" ".join(f"--variant {n}={p}" for n, p in paths.items()))


if __name__ == "__main__":
    main()
