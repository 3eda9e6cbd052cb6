"""Make Triton's CPU interpreter do bf16 arithmetic the way the GPU does.

The interpreter stores bf16 values as raw uint16 bits. Some Triton releases (3.9
among them) have two bugs there:

- ``create_dot`` hands those bits straight to ``numpy.matmul``, so a bf16 dot returns
  garbage. On the GPU a bf16 x bf16 product is exact in the fp32 accumulator, so
  widening both operands to fp32 first reproduces the GPU's arithmetic.
- an fp32 -> bf16 cast truncates instead of rounding to nearest even (the GPU's
  ``.to(tl.bfloat16)``), doubling bf16 rounding error and making the 2x rule flaky.

Applied only under ``TRITON_INTERPRET=1``, and only when the interpreter has the
shape we expect; otherwise nothing is touched.
"""

from __future__ import annotations

from flashtune._env import interpreting


def patch_interpreter_bf16_dot() -> bool:
    if not interpreting():
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover
        return False
    builder = getattr(interp, "InterpreterBuilder", None)
    convert = getattr(interp, "_convert_float", None)
    orig = getattr(builder, "create_dot", None)
    if builder is None or convert is None or orig is None:
        return False
    if getattr(orig, "_flashtune_bf16", False):
        return True
    import numpy as np

    def widen(h):  # type: ignore[no-untyped-def]
        if h.dtype.scalar == tl.bfloat16:
            data = convert(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interp.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore
        return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._flashtune_bf16 = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot

    orig_cast = getattr(builder, "cast_impl", None)
    if orig_cast is not None:
        import torch

        def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
            if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
                # torch's float -> bfloat16 conversion rounds to nearest even, like the GPU.
                t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
                bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                return interp.TensorHandle(bits.reshape(src.data.shape), tl.bfloat16)
            return orig_cast(self, src, dst_type)

        builder.cast_impl = cast_impl
        for name in ("create_fp_trunc", "create_fp_ext", "create_si_to_fp", "create_ui_to_fp",
                     "create_fp_to_si", "create_fp_to_ui"):
            if hasattr(builder, name):
                setattr(builder, name,
                        lambda self, src, dst_type, _c=cast_impl: _c(self, src, dst_type))
    return True
