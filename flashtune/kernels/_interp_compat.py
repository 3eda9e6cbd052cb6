"""Make Triton's CPU interpreter compute bf16 ``tl.dot`` correctly.

The interpreter stores bf16 values as raw uint16 bits, and some Triton releases
(3.9 among them) hand those bits straight to ``numpy.matmul`` in ``create_dot``,
so a bf16 dot returns garbage. On the GPU a bf16 x bf16 product is exact in the
fp32 accumulator, so widening both operands to fp32 first reproduces the GPU's
arithmetic. Applied only under ``TRITON_INTERPRET=1``, and only when the
interpreter has the shape we expect; otherwise nothing is touched.
"""

from __future__ import annotations

import os


def patch_interpreter_bf16_dot() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
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
    return True
