"""Part of the Hopper backward's exponentials on the FMA pipes: copies of
``flashtune/kernels/attn_bwd_hopper.py`` whose Pᵀ = exp2(S·scale - LSE) computes one value
of every ``K`` (2 or 4) with a polynomial instead of ``ex2.approx`` (the SFU).

Why: session 50's ablation (``bwd_ablate.py``, ``noexp``) ran the fixed order 5-12% faster
at head dim 128 without the exponentials. With 64-row query tiles a program's two Sᵀ
tiles (64 keys x 64 queries each) are 8,192 ``ex2`` per query tile, at 16 a clock per SM
about 500 of the ~5,000 clocks a tile takes, so the SFU's throughput alone does not explain
5-12%: its latency on each consumer's path may. The SM's FMA pipes do 128 a clock; moving
a share of the exponentials to them (as FlashAttention 4 does on Blackwell) tells which:
the polynomial is longer per value but runs beside the SFU's share.

The polynomial: x clamped at -126 (the masked -inf too; 2^-126 is as good as 0 beside
bf16's rounding), n = round(x) by the 1.5·2^23 trick (an add, no conversion
instruction), f = x - n in [-0.5, 0.5], 2^f by a degree-3 polynomial (three FMAs;
coefficients fitted here to a relative error of 1.0e-4, under bf16's rounding of P at
2^-9), and 2^n added to its exponent bits (a shift and an integer add). A thread's ``K``
consecutive registers (columns c, c + 1 of a row, and the next group's) go to one inline
PTX block: ``ex2.approx.ftz`` for the first ``K - 1``, the polynomial for the last.

Built for sm_90 with Triton 3.6 (``--show``, 4x16x4096x128, frag): the tree's kernel
issues 64 ``ex2`` per consumer thread and query tile; ``poly2`` 32 and 96 more FMAs,
``poly4`` 48 and 48 more; spills unchanged (fixed order 0-4 bytes, free 20/32). The
polynomial was checked in NumPy's float32 over [-140, 1] and -inf: relative error at most
1.01e-4 from -125 up, 2^-126 below, never negative or NaN.

On the H200 (session 51, BENCHMARKS.md): ``poly2`` passes the correctness grid; at the
default tiles the fixed order ran 0.96-1.04x (``poly4`` 1.00-1.04x) the kernel's speed,
but with the shipped configs (``bwd_shipped_variants.py``) ``poly4`` ran 1.00-1.02x at
D=128 unmasked, 0.96-0.98x at D=128 causal and 0.93-1.00x at D=64: not adopted.

    python3 benchmarks/experiments/bwd_exp_poly.py --dir D    # prints --variant arguments
    PYTHONPATH=<triton 3.6>:<tree>:<tree>/benchmarks python3 \\
        benchmarks/experiments/bwd_exp_poly.py --dir D --show
    python3 benchmarks/experiments/hopper_bwd_ab.py --variant head \\
        $(python3 benchmarks/experiments/bwd_exp_poly.py --dir D) --check poly2 \\
        --det-knobs '{"hopper_dq_frag": 1}' --free-knobs '{"hopper_dq_frag": 1}' \\
        --shapes 7,10,8,1 --out ab.json
"""

from __future__ import annotations

import argparse
import os
import re

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "flashtune",
                   "kernels", "attn_bwd_hopper.py")

# 12582912 = 1.5 * 2^23; -126; 1; the polynomial's coefficients of f, f^2, f^3.
_POLY = ("max.f32 x, {src}, 0fC2FC0000;\n\t"
         "add.rn.f32 t, x, 0f4B400000;\n\t"
         "sub.rn.f32 f, t, 0f4B400000;\n\t"
         "sub.rn.f32 f, x, f;\n\t"
         "fma.rn.f32 p, f, 0f3D61510B, 0f3E780627;\n\t"
         "fma.rn.f32 p, p, f, 0f3F317AFD;\n\t"
         "fma.rn.f32 p, p, f, 0f3F800000;\n\t"
         "mov.b32 j, t;\n\t"
         "shl.b32 j, j, 23;\n\t"
         "mov.b32 q, p;\n\t"
         "add.s32 {dst}, q, j;")


def _asm(k: int) -> tuple[str, str]:
    """The inline PTX and its constraints for ``k`` values a block: outputs $0..$k-1,
    inputs $k..$2k-1."""
    lines = ["{", ".reg .f32 x, t, f, p;", ".reg .b32 j, q;"]
    for i in range(k - 1):
        lines.append(f"ex2.approx.ftz.f32 ${i}, ${k + i};")
    lines.append(_POLY.format(src=f"${2 * k - 1}", dst=f"${k - 1}"))
    lines.append("}")
    return "\n\t".join(lines), ",".join(["=r"] * k + ["r"] * k)


HELPER = '''

@gluon.jit
def _exp2_mix(x):
    """exp2(x) with one value of every {k} on the FMA pipes (see bwd_exp_poly.py)."""
    return gl.inline_asm_elementwise({asm!r}, {cons!r}, [x], dtype=gl.float32, is_pure=True,
                                     pack={k})


@gluon.jit
def _bwd_consumer('''


def _one(text: str, old: str, new: str, what: str) -> str:
    n = text.count(old)
    if n != 1:
        raise SystemExit(f"{what}: expected the anchor once, found it {n} times: {old[:60]!r}")
    return text.replace(old, new)


def transform(t: str, k: int) -> str:
    asm, cons = _asm(k)
    t = _one(t, "\n\n@gluon.jit\ndef _bwd_consumer(", HELPER.format(k=k, asm=asm, cons=cons),
             "_exp2_mix")
    t = _one(t, "p_t = gl.exp2(t * cap_log2 - lse2[None, :])",
             "p_t = _exp2_mix(t * cap_log2 - lse2[None, :])", "softcap exp2")
    return _one(t, "p_t = gl.exp2(s_t * qk_scale - lse2[None, :])",
                "p_t = _exp2_mix(s_t * qk_scale - lse2[None, :])", "exp2")


def show(path: str) -> None:
    """Build a copy (fixed and free order, frag, 4x16x4096x128) for sm_90 and print its
    ex2 and FMA counts and spills."""
    import torch
    from bwd_spills import ptxas_report, use_module
    from probe_ptxas import BUILT_PTX

    from flashtune.kernels.attn_bwd import bwd_steps
    from flashtune.kernels.config import BWD_HOPPER, BwdConfig
    from flashtune.problem import default_scale

    use_module(path)
    for det in (True, False):
        q, do, o, k, v = (torch.empty(4, 16, 4096, 128, dtype=torch.bfloat16)
                          for _ in range(5))
        cfg = BwdConfig(variant=BWD_HOPPER, hopper_block_m=64, hopper_block_n=128,
                        hopper_stages=2, hopper_regs=240, hopper_dq_frag=1)
        BUILT_PTX.clear()
        _, steps = bwd_steps(do, q, k, v, o, torch.empty(4, 16, 4096), causal=False,
                             sm_scale=default_scale(128), window=(-1, -1), softcap=0.0,
                             config=cfg, deterministic=det)
        for _, step in steps:
            step()
        ptx = BUILT_PTX["_attn_bwd_hopper_kernel"]
        print(f"  {'fixed' if det else 'free'}: {len(re.findall(r'ex2.approx', ptx))} ex2, "
              f"{len(re.findall(r'fma.rn.f32', ptx))} fma.rn.f32; {ptxas_report(ptx)}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where to write the module copies")
    ap.add_argument("--show", action="store_true",
                    help="build them for sm_90 (compile-only, Triton 3.6) and count")
    args = ap.parse_args()
    with open(SRC) as f:
        head = f.read()
    os.makedirs(args.dir, exist_ok=True)
    specs = []
    if args.show:
        print("head (the tree's kernel)")
        show(SRC)
    for k in (2, 4):
        path = os.path.join(args.dir, f"attn_bwd_hopper_poly{k}.py")
        with open(path, "w") as f:
            f.write(transform(head, k))
        if args.show:
            print(f"poly{k}")
            show(path)
        specs.append(f"--variant poly{k}={path}")
    if not args.show:
        print(" ".join(specs))


if __name__ == "__main__":
    main()
