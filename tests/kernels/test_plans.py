"""Per-call work cached by the call's signature (flashtune.kernels._plans) and the bound
launches under it (flashtune.kernels._bound): a seen signature validates, keys and
resolves nothing again; what validation would reject is never served from the cache;
layouts and unaligned data get launches of their own; the one autograd wiring serves
dense and packed calls without the custom ops. Real kernels throughout (Triton's
interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from flashtune._env import interpreting
from flashtune.kernels import _bound, _plans, attention, varlen
from flashtune.kernels.attention import call_plan, flash_attention
from flashtune.kernels.attn_bwd import BwdLaunch
from flashtune.kernels.attn_fwd import FwdLaunch
from flashtune.kernels.config import (
    BWD_FUSED,
    BWD_ONE_LAUNCH,
    BWD_TWO_KERNEL,
    HOPPER,
    FwdConfig,
    default_bwd,
    default_fwd,
)
from flashtune.kernels.reference import attention_ref
from flashtune.problem import Problem

B, HQ, HK, S, D = 1, 2, 1, 24, 16


def _qkv(device: str, seed: int = 0, grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, HQ, S, D), (B, HK, S, D), (B, HK, S, D))
    return [torch.randn(s, generator=g).to(device=device, dtype=torch.float16)
            .requires_grad_(grad) for s in shapes]


@pytest.fixture
def counting_resolver():
    """The heuristic resolver, counting its calls (installed for the test, then restored)."""
    calls: list[str] = []
    before = attention.get_config_resolver()

    def resolver(direction, q, k, causal, window, softcap, deterministic):
        calls.append(direction)
        return _plans.heuristic_resolver(direction, q, k, causal, window, softcap,
                                         deterministic)

    attention.set_config_resolver(resolver)
    yield calls
    attention.set_config_resolver(before)


def test_seen_signature_only_launches(device, monkeypatch, counting_resolver) -> None:
    validated: list[int] = []
    real = attention.validate
    monkeypatch.setattr(attention, "validate", lambda *a: validated.append(1) or real(*a))
    q, k, v = _qkv(device)
    first = flash_attention(q, k, v, causal=True)
    plan = call_plan(q, k, v, True, None, (-1, -1), 0.0, True, None)
    launch = plan.fwd
    assert validated == [1] and counting_resolver == ["fwd"] and launch is not None
    for seed in (1, 2):  # new data, same signature: the same plan and launch, no new work
        q2, k2, v2 = _qkv(device, seed)
        out = flash_attention(q2, k2, v2, causal=True)
        ref, _ = attention_ref(q2, k2, v2, causal=True)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert validated == [1] and counting_resolver == ["fwd"] and plan.fwd is launch
    assert torch.equal(flash_attention(q, k, v, causal=True), first)


@pytest.mark.parametrize("good, bad, match", [
    (dict(causal=True), dict(causal=1), "causal"),
    (dict(window_size=(1, -1)), dict(window_size=(True, -1)), "window_size"),
    (dict(softcap=0), dict(softcap=False), "softcap"),
    (dict(softmax_scale=1), dict(softmax_scale=True), "softmax_scale"),
    (dict(deterministic=True), dict(deterministic=1), "deterministic"),
])
def test_what_validation_rejects_is_never_served_from_the_cache(good, bad, match,
                                                                 device) -> None:
    q, k, v = _qkv(device)
    flash_attention(q, k, v, **good)  # equal to ``bad`` as a dict key, and cached
    with pytest.raises(TypeError, match=match):
        flash_attention(q, k, v, **bad)


def test_an_equal_config_with_a_mistyped_field_is_rejected(device) -> None:
    q, k, v = _qkv(device)
    p = Problem.from_tensors(q, k)
    good = default_fwd(p)
    flash_attention(q, k, v, config=good)
    bad = FwdConfig(**{**good.__dict__, "block_m": float(good.block_m)})
    assert bad == good and hash(bad) == hash(good)
    with pytest.raises(ValueError, match="block_m"):
        flash_attention(q, k, v, config=bad)


def test_layouts_and_unaligned_data_get_launches_of_their_own(device) -> None:
    q, k, v = _qkv(device)
    want, _ = attention_ref(q, k, v)
    flash_attention(q, k, v)
    aligned_plan = call_plan(q, k, v, False, None, (-1, -1), 0.0, True, None)
    # The same values in (B, S, H, D) storage, viewed as (B, H, S, D): other strides.
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    torch.testing.assert_close(flash_attention(qt, kt, vt), want, atol=2e-2, rtol=2e-2)
    assert call_plan(qt, kt, vt, False, None, (-1, -1), 0.0, True, None) is not aligned_plan
    # Data one element past a 16-byte boundary: same shape and strides, another pointer class.
    buf = [torch.empty(t.numel() + 1, dtype=t.dtype, device=device) for t in (q, k, v)]
    qo, ko, vo = (b[1:].view_as(t).copy_(t) for b, t in zip(buf, (q, k, v), strict=True))
    assert qo.data_ptr() % _bound.ALIGN and qo.stride() == q.stride()
    launch = aligned_plan.fwd
    torch.testing.assert_close(flash_attention(qo, ko, vo), want, atol=2e-2, rtol=2e-2)
    assert call_plan(qo, ko, vo, False, None, (-1, -1), 0.0, True, None) is aligned_plan
    assert aligned_plan.fwd is launch  # the aligned launch was neither used nor replaced


def test_backward_launches_cached_by_the_gradient_layout(device, seed) -> None:
    q, k, v = _qkv(device, grad=True)
    out = flash_attention(q, k, v, causal=True)
    out.float().sum().backward()  # dO: contiguous
    plan = call_plan(q, k, v, True, None, (-1, -1), 0.0, True, None)
    assert len(plan.bwd) == 1
    grads = [t.grad.clone() for t in (q, k, v)]
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attention_ref(*ref, causal=True)[0].float().sum().backward()
    for got, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, r.grad.to(got.dtype), atol=3e-2, rtol=3e-2)
    for t in (q, k, v):
        t.grad = None
    do = torch.randn(B, S, HQ, D, dtype=out.dtype, device=device).transpose(1, 2)
    flash_attention(q, k, v, causal=True).backward(do)  # dO in (B, S, H, D) storage
    assert len(plan.bwd) == 2
    assert all(isinstance(b, BwdLaunch) for b in plan.bwd.values())


def test_eager_backward_makes_no_gradient_for_the_lse(device, seed) -> None:
    """The LSE is not differentiable: autograd must not allocate and zero-fill a gradient
    for it on every backward (it did, one aten.zeros per step, until gradients stopped
    being materialized)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv(device, grad=True)
    out = flash_attention(q, k, v, causal=True)
    do = torch.randn_like(out)
    with Ops() as ops:
        out.backward(do)
    assert ops.names and not [n for n in ops.names if n.startswith(("zeros", "zero_", "fill"))]
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attention_ref(*ref, causal=True)[0].backward(do.float())
    for got, r in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(got.grad, r.grad.to(got.dtype), atol=3e-2, rtol=3e-2)


def test_eager_packed_calls_share_the_wiring_and_skip_the_custom_ops(device) -> None:
    lens = [5, 11]
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(16, h, D, generator=g).to(device=device, dtype=torch.float16)
               .requires_grad_() for h in (HQ, HK, HK))
    ops_before = len(_plans.caches["op"])
    out = varlen.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    out.float().square().sum().backward()
    assert len(_plans.caches["op"]) == ops_before  # no custom op ran
    for i, (a, b) in enumerate(((0, 5), (5, 16))):
        qi, ki, vi = (t.detach()[a:b].transpose(0, 1).unsqueeze(0).requires_grad_()
                      for t in (q, k, v))
        ref = attention_ref(qi, ki, vi, causal=True)[0]
        torch.testing.assert_close(out[a:b], ref[0].transpose(0, 1), atol=2e-2, rtol=2e-2)
        ref.float().square().sum().backward()
        torch.testing.assert_close(q.grad[a:b], qi.grad[0].transpose(0, 1).to(q.dtype),
                                   atol=3e-2, rtol=3e-2, msg=f"sequence {i}")


def test_bound_launch_lists_every_parameter_in_order(device) -> None:
    """The tail a bound launch hands the compiled kernel's launcher after the pointers:
    every later parameter, in declaration order, constexprs included (what
    JITFunction.run passes), for each real kernel."""
    q, k, v = _qkv(device)
    p = Problem.from_tensors(q, k, causal=True)
    fwd = FwdLaunch(q, k, v, causal=True, sm_scale=0.25, window=(-1, -1), softcap=0.0,
                    config=default_fwd(p))
    o = torch.empty_like(q)
    launches = [fwd.launch]
    for variant, steps in ((BWD_TWO_KERNEL, ["pre", "dkdv", "dq"]), (BWD_ONE_LAUNCH,
                           ["pre", "one"]), (BWD_FUSED, ["one"])):
        bwd = BwdLaunch(o, q, k, v, o, causal=True, sm_scale=0.25, window=(-1, -1),
                        softcap=0.0, config=default_bwd(p, variant))
        assert [name for name, _ in bwd.launches] == steps
        launches += [launch for _, launch in bwd.launches]
    try:  # the Gluon kernel, where this Triton has Gluon's Hopper API
        from flashtune.kernels.attn_fwd_hopper import HopperLaunch
    except ImportError:
        pass
    else:
        h = FwdConfig(variant=HOPPER, block_m=128, block_n=64, num_stages=2)
        qh, kh = (torch.randn(1, n, 128, 64, dtype=torch.bfloat16, device=device)
                  for n in (2, 1))
        launches.append(HopperLaunch(qh, kh, kh, mask=(0, 0, False, False),
                                     scales=(0.125, 0.0, 0.0), softcap=0.0, config=h).launch)
        cu = torch.tensor([0, 50, 128], dtype=torch.int32, device=device)
        qp, kp = (torch.randn(128, n, 64, dtype=torch.bfloat16, device=device) for n in (2, 1))
        launches.append(HopperLaunch(qp, kp, kp, mask=(0, 0, False, True),
                                     scales=(0.125, 0.0, 0.0), softcap=0.0, config=h,
                                     packed=(cu, cu, 78, 78)).launch)
    for launch in launches:
        tail = launch._tail()
        names = launch.kernel.arg_names
        assert tail is not None and launch.n_dynamic + len(tail) == len(names)
        for i, name in enumerate(names):
            if name in launch.kwargs:
                assert tail[i - launch.n_dynamic] == launch.kwargs[name], name
            elif i >= launch.n_dynamic:
                assert tail[i - launch.n_dynamic] == launch.args[i], name
    before = dict(_bound.counts)
    fwd(q, k, v)
    fwd(q, k, v)
    if interpreting():  # every launch goes through kernel[grid]
        assert fwd.launch.tail is None and not fwd.launch.bound
        assert _bound.counts["jit"] == before["jit"] + 2
    else:  # the first binds, the second runs through the compiled kernel
        assert _bound.counts["bind"] == before["bind"] + 1
        assert _bound.counts["bound"] == before["bound"] + 1


def test_a_call_that_drops_the_lse_writes_it_to_scratch(device, monkeypatch) -> None:
    """A forward whose LSE nobody reads (no grad, return_lse=False) writes it to the
    device's scratch buffer instead of a new one; every other call gets its own LSE, and
    O is the same either way. Past SCRATCH_LSE_ROWS rows a call allocates as before."""
    from flashtune.kernels import attn_fwd

    q, k, v = _qkv(device)
    p = Problem.from_tensors(q, k, causal=True)
    launch = FwdLaunch(q, k, v, causal=True, sm_scale=0.25, window=(-1, -1), softcap=0.0,
                       config=default_fwd(p))
    scratch = attn_fwd.scratch_lse(q.device, B * HQ * S)
    assert scratch is not None and launch.scratch is scratch
    o1, lse1 = launch(q, k, v)
    o2, lse2 = launch(q, k, v, lse=False)
    assert lse2 is scratch and lse1.data_ptr() != scratch.data_ptr()
    assert torch.equal(o1, o2) and torch.equal(lse1.flatten(), scratch[: lse1.numel()])
    o3, lse3 = launch(q, k, v)
    assert lse3.data_ptr() not in (lse1.data_ptr(), scratch.data_ptr())
    # Through the public call: the same output with and without the LSE returned.
    with torch.no_grad():
        out = flash_attention(q, k, v, causal=True)
        out2, lse4 = flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, out2) and torch.equal(lse4, lse1)
    assert lse4.data_ptr() != scratch.data_ptr()
    monkeypatch.setattr(attn_fwd, "SCRATCH_LSE_ROWS", B * HQ * S - 1)
    big = FwdLaunch(q, k, v, causal=True, sm_scale=0.25, window=(-1, -1), softcap=0.0,
                    config=default_fwd(p))
    assert big.scratch is None and big(q, k, v, lse=False)[1].data_ptr() != scratch.data_ptr()


def test_hopper_launch_reads_a_packed_batch_through_rank4_views(device) -> None:
    """A packed (total, H, D) batch: descriptors over (1, H, total, D) views of the same
    data, O addressed by row and head (no batch stride), the LSE (Hq, total_q), the grid
    sized by the longest sequence; a dense batch keeps its own layout."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from flashtune.kernels.attn_fwd_hopper import HopperLaunch

    h = FwdConfig(variant=HOPPER, block_m=128, block_n=64, num_stages=2)
    cu = torch.tensor([0, 50, 50, 300], dtype=torch.int32, device=device)
    q = torch.randn(300, 4, 64, dtype=torch.bfloat16, device=device)
    k = torch.randn(300, 2, 64, dtype=torch.bfloat16, device=device)
    launch = HopperLaunch(q, k, k, mask=(0, 0, False, True), scales=(0.125, 0.0, 0.0),
                          softcap=0.0, config=h, packed=(cu, cu, 250, 250))
    args, kw = launch.launch.args, launch.launch.kwargs
    assert launch.lse_shape == (4, 300) and kw["IS_VARLEN"] and kw["GQA"] == 2
    assert args[8:14] == [0, 64, 256, 4, 300, 300]  # O strides (batch, head, row), Hq, totals
    n_m = args[16]
    assert n_m == 2 and args[17] == n_m * 3 * 4 == launch.launch.grid[0]  # tiles: 250 rows
    assert args[18] == launch.launch.grid[0] and args[19] == 3 * 4  # grid size, B * Hq
    tq, tk, _, to = launch.templates
    assert (list(to.shape), list(to.block_shape)) == ([1, 4, 300, 64], [1, 1, 64, 64])
    assert (list(tq.shape), list(tq.strides)) == ([1, 4, 300, 64], [76800, 64, 256, 1])
    assert (list(tk.shape), list(tk.block_shape)) == ([1, 2, 300, 64], [1, 1, 64, 64])

    dense = HopperLaunch(q.view(3, 100, 4, 64).transpose(1, 2),
                         k.view(3, 100, 2, 64).transpose(1, 2), k.view(3, 100, 2, 64)
                         .transpose(1, 2), mask=(0, 0, False, True), scales=(0.125, 0.0, 0.0),
                         softcap=0.0, config=h)
    assert dense.lse_shape == (3, 4, 100) and not dense.launch.kwargs["IS_VARLEN"]
    assert dense.launch.args[8:14] == [25600, 64, 256, 4, 100, 100]


def _gpu_inputs(seed: int, s: int = 257, d: int = 64) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
            for shape in ((2, 4, s, d), (2, 2, s, d), (2, 2, s, d), (2, 4, s, d))]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", [BWD_TWO_KERNEL, BWD_ONE_LAUNCH, BWD_FUSED])
def test_bound_launches_give_the_bits_of_jit_launches(causal: bool, variant: int,
                                                      seed: int) -> None:
    """Second and later calls go through the bound compiled kernels (forward: the Hopper
    kernel where it runs, else the portable one; the backward's kernels: three, two or
    one by variant) and give exactly what kernel[grid] launches give, on a side stream
    too."""
    from flashtune.kernels.attn_bwd import attn_bwd
    from flashtune.kernels.attn_fwd import attn_fwd

    q, k, v, do = _gpu_inputs(seed)
    p = Problem.from_tensors(q, k, causal=causal)
    fcfg, bcfg = default_fwd(p), default_bwd(p, variant)
    n_bwd = {BWD_TWO_KERNEL: 3, BWD_ONE_LAUNCH: 2, BWD_FUSED: 1}[variant]
    scale = D ** -0.5
    want_o, want_lse = attn_fwd(q, k, v, causal=causal, sm_scale=scale, window=(-1, -1),
                                softcap=0.0, config=fcfg)
    want = attn_bwd(do, q, k, v, want_o, want_lse, causal=causal, sm_scale=scale,
                    window=(-1, -1), softcap=0.0, config=bcfg)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    for i in range(3):
        before, before_native = dict(_bound.counts), _native_launches()
        stream = torch.cuda.Stream() if i == 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for t in (qg, kg, vg):
                t.grad = None
            o, lse = flash_attention(qg, kg, vg, causal=causal, softmax_scale=scale,
                                     return_lse=True, config=(fcfg, bcfg))
            o.backward(do)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
        for got, ref in zip((qg.grad, kg.grad, vg.grad), want, strict=True):
            assert torch.equal(got, ref)
        if i:  # 1 forward + the backward's launches, all bound (or by the C++ node)
            fwd, bwd = (a - b for a, b in zip(_native_launches(), before_native, strict=True))
            assert _bound.counts["bound"] - before["bound"] + fwd + bwd * n_bwd == 1 + n_bwd, \
                (_bound.counts, fwd, bwd)
            assert _bound.counts["jit"] == before["jit"]


def _native_launches() -> tuple[int, int]:
    """(forwards, backwards) the C++ extension ran from programs: their launches are not
    counted in ``_bound.counts``."""
    from flashtune.kernels import _native

    ext = _native.module(wait=False) if _native.status()["state"] == "loaded" else None
    return (ext.forward_count(), ext.counts()[0]) if ext is not None else (0, 0)


@pytest.mark.gpu
def test_a_launch_hook_gets_every_launch(seed: int) -> None:
    """With a launch hook installed (a profiler), launches go through kernel[grid], which
    calls it (the C++ extension's programs stand aside); without, they are bound again."""
    from triton import knobs

    q, k, v, _ = _gpu_inputs(seed, s=128)
    flash_attention(q, k, v)
    flash_attention(q, k, v)
    seen: list[object] = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        before = dict(_bound.counts)
        out = flash_attention(q, k, v)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1 and _bound.counts["jit"] == before["jit"] + 1
    before, before_native = dict(_bound.counts), _native_launches()
    assert torch.equal(flash_attention(q, k, v), out)
    fwd = _native_launches()[0] - before_native[0]
    assert _bound.counts["bound"] + fwd == before["bound"] + 1
