"""The C++ backward node (flashtune.kernels._native): built with the system compiler
against this torch, it wires eager calls as the Python Function does (same gradients,
bit for bit; the autograd contract: saved-tensor checks, hooks, errors), and on a GPU
runs the plan's bound backward without Python, with the bits of the Python path. On the
CPU (Triton's interpreter) every backward goes through ``Plan.backward``, so these tests
check the node's wiring there and its programs on the GPU."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from flashtune.kernels import _autograd, _native, _plans
from flashtune.kernels.attention import call_plan, flash_attention
from flashtune.kernels.config import (
    BWD_FUSED,
    BWD_ONE_LAUNCH,
    BWD_TWO_KERNEL,
    default_bwd,
    default_fwd,
)
from flashtune.kernels.varlen import flash_attn_varlen_func
from flashtune.problem import Problem

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None
                                and not os.environ.get("CXX"), reason="no C++ compiler")


@pytest.fixture
def ext(monkeypatch: pytest.MonkeyPatch):
    """The extension, the node switched on for every device (FLASHTUNE_NATIVE=1)."""
    monkeypatch.setenv(_native.ENV, "1")
    module = _native.module(wait=True)
    assert module is not None, _native.status()
    return module


def _inputs(device: str, seed: int, shape_q=(2, 4, 37, 32), shape_k=(2, 2, 29, 32),
            dtype=torch.float16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(shape_q, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(shape_k, generator=g).to(device, dtype) for _ in range(2))
    return [q, k, v, do]


def _grads(q, k, v, do, **kw):
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = flash_attention(qg, kg, vg, **kw)
    return o, o.grad_fn, torch.autograd.grad(o, (qg, kg, vg), do)


def _python_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_autograd, "_native_for", lambda q: None)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(5, 3), softcap=2.5)],
                         ids=["causal", "window-softcap"])
def test_the_node_gives_the_python_functions_gradients(ext, kw, device: str, seed: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, do = _inputs(device, seed)
    native, python = ext.counts()
    o, fn, grads = _grads(q, k, v, do, **kw)
    assert fn.name() == "FlashAttentionBackward"
    assert sum(ext.counts()) == native + python + 1  # one backward, by whichever path
    assert tuple(ext.slots()) == _native.SLOTS  # the programs' slot names, on both sides
    with monkeypatch.context() as m:
        _python_node(m)
        o2, fn2, want = _grads(q, k, v, do, **kw)
    assert fn2.name() == "AttentionBackward"
    assert torch.equal(o, o2)
    for got, ref in zip(grads, want, strict=True):
        assert torch.equal(got, ref)


def test_a_packed_batch_goes_through_the_node(ext, device: str, seed: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(seed)
    lens = [7, 0, 19, 4]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    total = sum(lens)
    q, k, v, do = (torch.randn(total, h, 32, generator=g).to(device, torch.bfloat16)
                   for h in (4, 2, 2, 4))

    def run():
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = flash_attn_varlen_func(qg, kg, vg, cu, cu, max(lens), max(lens), causal=True)
        return out.grad_fn.name(), torch.autograd.grad(out, (qg, kg, vg), do)

    name, grads = run()
    with monkeypatch.context() as m:
        _python_node(m)
        name2, want = run()
    assert (name, name2) == ("FlashAttentionBackward", "AttentionBackward")
    for got, ref in zip(grads, want, strict=True):
        assert torch.equal(got, ref)


def test_the_node_keeps_autograds_contract(ext, device: str, seed: int) -> None:
    """A second backward without retain_graph, or after an input changed in place, fails
    as it does for any PyTorch op; with retain_graph it repeats; inputs that need no
    gradient get none."""
    q, k, v, do = _inputs(device, seed)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = flash_attention(qg, kg, vg, causal=True)
    first = torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
    again = torch.autograd.grad(o, (qg, kg, vg), do)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(o, (qg, kg, vg), do)

    o = flash_attention(qg, kg, vg)
    with torch.no_grad():
        kg.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.backward(do)

    kn = k.detach().clone()
    o = flash_attention(qg, kn, vg)
    dq, dv = torch.autograd.grad(o, (qg, vg), do)
    assert kn.grad is None and dq.shape == q.shape and dv.shape == v.shape


def test_saved_tensor_hooks_pack_and_unpack_what_the_node_saves(ext, device: str,
                                                                seed: int) -> None:
    """Activation offloading and checkpointing go through these hooks: the node's saved
    tensors (q, k, v, the LSE and O) are packed at the forward and unpacked at the
    backward, whose gradients are those of an unhooked run."""
    q, k, v, do = _inputs(device, seed)
    packed, unpacked = [], []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t.clone()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(tuple(t.shape))
        return t

    _, _, want = _grads(q, k, v, do)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        _, _, grads = _grads(q, k, v, do)
    shapes = sorted([tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(q.shape[:3]),
                     tuple(q.shape)])
    assert sorted(packed) == shapes and sorted(unpacked) == shapes
    for got, ref in zip(grads, want, strict=True):
        assert torch.equal(got, ref)


def test_an_error_in_the_backward_reaches_the_caller_as_raised(
        ext, device: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, do = _inputs(device, seed)
    qg = q.detach().clone().requires_grad_()
    o = flash_attention(qg, k, v)

    def broken(self, *args):
        raise ValueError("the backward failed on purpose")

    plan = call_plan(qg, k, v, False, None, (-1, -1), 0.0, True, None)
    plan.native_handle(ext).clear()  # no program: the Python backward runs
    monkeypatch.setattr(_plans.Plan, "backward", broken)
    with pytest.raises(ValueError, match="failed on purpose"):
        o.backward(do)


def test_a_failed_build_leaves_nothing_and_the_python_node_serves(
        device: str, seed: int, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.ENV, "1")
    monkeypatch.setenv(_native.DIR_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    _native.reset()
    try:
        assert _native.module() is None
        status = _native.status()
        assert status["state"] == "failed" and "compiling" in status["error"], status
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
        q, k, v, do = _inputs(device, seed)
        o, fn, grads = _grads(q, k, v, do)
        assert fn.name() == "AttentionBackward" and grads[0].shape == q.shape
    finally:
        _native.reset()


def test_a_build_removes_what_a_dead_build_left(tmp_path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that exits during a background build leaves the compiler writing a
    temporary library; the next build on the host removes it, and leaves a running build's
    output and another host's alone."""
    import socket
    import subprocess
    import sys

    monkeypatch.setenv(_native.DIR_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # the build itself fails at once
    _native.reset()
    try:
        folder = _native.build_dir()
        folder.mkdir(parents=True)
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        host = socket.gethostname()
        dead = folder / f".build-{host}-{int(gone.stdout)}-x1y2.so"
        running = folder / f".build-{host}-{os.getpid()}-a1b2.so"
        elsewhere = folder / f".build-{host}x-{int(gone.stdout)}-c3d4.so"
        for p in (dead, running, elsewhere):
            p.write_bytes(b"half a library")
        with pytest.raises(RuntimeError, match="compiling"):
            _native.build()
        assert sorted(p.name for p in folder.iterdir()) == \
            sorted(p.name for p in (running, elsewhere))
    finally:
        _native.reset()


def test_switched_off_the_python_node_serves(device: str, seed: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.ENV, "0")
    _native.reset()
    try:
        q, k, v, do = _inputs(device, seed)
        _, fn, _ = _grads(q, k, v, do)
        assert fn.name() == "AttentionBackward" and _native.status()["state"] == "off"
    finally:
        _native.reset()


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", [BWD_TWO_KERNEL, BWD_ONE_LAUNCH, BWD_FUSED])
def test_programs_give_the_bits_of_the_python_backward(ext, variant: int, causal: bool,
                                                       seed: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """From the second backward of a signature on, the node launches the bound kernels
    itself (no Python), on the current stream, with the Python path's bits."""
    q, k, v, do = _inputs("cuda", seed, dtype=torch.bfloat16)
    p = Problem.from_tensors(q, k, causal=causal)
    cfg = (default_fwd(p), default_bwd(p, variant))
    with monkeypatch.context() as m:
        _python_node(m)
        _, _, want = _grads(q, k, v, do, causal=causal, config=cfg)
    for i in range(4):
        before = ext.counts()
        stream = torch.cuda.Stream() if i == 3 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _, fn, grads = _grads(q, k, v, do, causal=causal, config=cfg)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        assert fn.name() == "FlashAttentionBackward"
        for got, ref in zip(grads, want, strict=True):
            assert torch.equal(got, ref)
        native, python = (a - b for a, b in zip(ext.counts(), before, strict=True))
        assert (native, python) == ((0, 1) if i == 0 else (1, 0)), (i, native, python)


@pytest.mark.gpu
def test_forgetting_a_plans_backward_drops_its_programs(ext, seed: int) -> None:
    q, k, v, do = _inputs("cuda", seed, dtype=torch.bfloat16)
    for _ in range(2):
        _grads(q, k, v, do)
    plan = call_plan(q, k, v, False, None, (-1, -1), 0.0, True, None)
    assert len(plan.native) == 1
    assert _plans.forget() >= 1 and len(plan.native) == 0
    steps = []
    for _ in range(2):
        before = ext.counts()
        _grads(q, k, v, do)
        steps.append(tuple(a - b for a, b in zip(ext.counts(), before, strict=True)))
    assert steps == [(0, 1), (1, 0)]  # resolved and bound again, then native


@pytest.mark.gpu
def test_a_cuda_graph_captures_the_native_backward(ext, seed: int) -> None:
    """Captured on a side stream after warm-up (the program exists), replayed on new data:
    the gradients of eager calls on that data."""
    q, k, v, do = _inputs("cuda", seed, dtype=torch.bfloat16)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.autograd.grad(flash_attention(qg, kg, vg, causal=True), (qg, kg, vg), do)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    before = ext.counts()
    with torch.cuda.graph(graph):
        out = flash_attention(qg, kg, vg, causal=True)
        grads = torch.autograd.grad(out, (qg, kg, vg), do)
    assert ext.counts()[0] == before[0] + 1
    fresh = _inputs("cuda", seed + 1, dtype=torch.bfloat16)
    with torch.no_grad():
        for dst, src in zip((qg, kg, vg, do), fresh, strict=True):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _, _, want = _grads(*fresh, causal=True)
    for got, ref in zip(grads, want, strict=True):
        assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_the_forward_program_gives_the_bits_of_the_python_forward(ext, causal: bool,
                                                                  seed: int) -> None:
    """A signature's bound portable forward is then allocated and launched by the
    extension: O and the LSE are the Python launch's, and a call that drops the LSE gets
    the same O."""
    from flashtune.kernels.attn_fwd import attn_fwd

    q, k, v, _ = _inputs("cuda", seed, dtype=torch.bfloat16)
    p = Problem.from_tensors(q, k, causal=causal)
    cfg = default_fwd(p)
    want_o, want_lse = attn_fwd(q, k, v, causal=causal, sm_scale=q.shape[-1] ** -0.5,
                                window=(-1, -1), softcap=0.0, config=cfg)
    runs = []
    for i in range(4):
        before = ext.forward_count()
        with torch.no_grad():
            if i < 3:
                o, lse = flash_attention(q, k, v, causal=causal, return_lse=True, config=cfg)
                assert torch.equal(lse, want_lse)
            else:
                o = flash_attention(q, k, v, causal=causal, config=cfg)
        assert torch.equal(o, want_o)
        runs.append(ext.forward_count() - before)
    assert runs == [0, 1, 1, 1]  # the first binds through Triton


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_programs_launch_on_the_tensors_device_whatever_the_current_one(
        ext, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors on cuda:1 with cuda:0 current: the programs, bound on cuda:1, launch there
    (its context made current for the launch, the current device restored) and give the
    Python path's bits."""
    q, k, v, do = _inputs("cuda:1", seed, dtype=torch.bfloat16)
    with monkeypatch.context() as m:
        _python_node(m)
        with torch.cuda.device(1):
            want_o, _, want = _grads(q, k, v, do)
    with torch.cuda.device(1):  # bind on the tensors' device
        _grads(q, k, v, do)
    torch.cuda.set_device(0)
    fwd, (native, _) = ext.forward_count(), ext.counts()
    o, _, grads = _grads(q, k, v, do)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert ext.forward_count() == fwd + 1 and ext.counts()[0] == native + 1
    assert torch.equal(o, want_o)
    for got, ref in zip(grads, want, strict=True):
        assert torch.equal(got, ref)


def _hopper_programs(seed: int) -> list[str]:
    """The Hopper backward's programs (child process, watchdog): for each config - whole
    and split in two, the accumulator zeroed whole or in blocks, dK and dV stored through
    descriptors or from registers, KV heads split into partials and summed, rows instead
    of fragments, the free order, the fixed order's staging without its turns - the second
    and later backwards of a signature run from the node's program (no Python), on the
    current stream or another, and give the Python path's bits (dQ of a free call, summed
    in no fixed order, within rounding of them);
    a CUDA graph captures a split program and replays it on new data."""
    import dataclasses

    from flashtune.kernels.attn_bwd_hopper import check_launch_plan
    from flashtune.kernels.config import BWD_HOPPER, check_bwd

    from .helpers import check_graph_replay, make_qkv

    os.environ[_native.ENV] = "1"
    ext = _native.module(wait=True)
    if ext is None:
        return [f"no extension: {_native.status()}"]
    if not ext.tma_ok():
        return ["the driver has no cuTensorMapEncodeTiled"]
    gen = torch.Generator().manual_seed(seed)
    failures = []
    cases = [
        (Problem(2, 4, 4, 1000, 1000, 64, "bf16", False, (300, 0), deterministic=True),
         "bhsd", dict(hopper_split=1)),
        (Problem(2, 8, 8, 1024, 1024, 128, "bf16", True, deterministic=True), "bshd",
         dict(hopper_split=2, hopper_dq_frag=1, hopper_dq_store_first=2, hopper_dkdv_tma=1)),
        (Problem(1, 8, 2, 1024, 1024, 64, "bf16", True, deterministic=True), "bhsd",
         dict(hopper_split=2, hopper_kv_rep=2, hopper_dq_frag=1, hopper_dq_store_first=2,
              hopper_dkdv_tma=1)),
        (Problem(2, 8, 2, 1030, 1030, 64, "fp16", False, deterministic=True), "bhsd",
         dict(hopper_split=1, hopper_kv_rep=4, hopper_dq_frag=0, hopper_dq_groups=1)),
        (Problem(2, 4, 4, 700, 700, 128, "bf16", True, deterministic=True), "bhsd",
         dict(hopper_split=2, hopper_dq_frag=0, hopper_dq_groups=0)),
        (Problem(2, 4, 4, 1030, 1030, 64, "bf16", True, deterministic=False), "bhsd",
         dict(hopper_split=2, hopper_dq_frag=1)),
        (Problem(4, 4, 4, 512, 512, 64, "bf16", True, deterministic=True), "bhsd",
         dict(hopper_split=2, hopper_dq_frag=1, hopper_dq_store_first=1)),
        (Problem(2, 4, 4, 1030, 1030, 128, "bf16", True, deterministic=False), "bhsd",
         dict(hopper_split=2, hopper_dq_frag=1, hopper_dq_fixed=1, hopper_dq_unordered=1,
              hopper_dq_store_first=0, hopper_dkdv_tma=1)),
    ]
    for p, layout, knobs in cases:
        name = f"{p} {layout} {knobs}"
        cfg = dataclasses.replace(default_bwd(p, BWD_HOPPER), **knobs)
        check_bwd(cfg, p)
        check_launch_plan(cfg, p.head_dim, p.deterministic)
        config = (default_fwd(p), cfg)
        q, k, v, do = make_qkv(p, "cuda", layout, gen)

        def step(q=q, k=k, v=v, do=do, p=p, config=config):
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out = flash_attention(qg, kg, vg, causal=p.causal, window_size=p.window,
                                  config=config, deterministic=p.deterministic)
            return out.grad_fn.name(), torch.autograd.grad(out, (qg, kg, vg), do)

        native_for = _autograd._native_for
        _autograd._native_for = lambda q: None  # the Python node
        try:
            _, want = step()
        finally:
            _autograd._native_for = native_for
        paths = []
        for i in range(4):
            before = ext.counts()
            stream = torch.cuda.Stream() if i == 3 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn, grads = step()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            paths.append(tuple(a - b for a, b in zip(ext.counts(), before, strict=True)))
            for label, got, ref in zip("qkv", grads, want, strict=True):
                if p.deterministic or label != "q":
                    same = torch.equal(got, ref)
                else:
                    same = torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
                if not same:
                    err = (got.float() - ref.float()).abs().max().item()
                    failures.append(f"{name}: call {i} d{label} differs (max {err:.3g})")
        if paths != [(0, 1), (1, 0), (1, 0), (1, 0)]:
            failures.append(f"{name}: (native, python) backwards per call {paths}")
        if knobs.get("hopper_split") == 2 and p.deterministic and layout == "bshd":
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def captured(qg=qg, kg=kg, vg=vg, do=do, p=p, config=config):
                out = flash_attention(qg, kg, vg, causal=p.causal, config=config)
                return torch.autograd.grad(out, (qg, kg, vg), do)

            try:
                check_graph_replay(captured, (qg, kg, vg, do), gen)
            except AssertionError as e:
                failures.append(f"{name}: graph replay: {e}")
    return failures


@pytest.mark.gpu
def test_hopper_programs_give_the_bits_of_the_python_backward(seed: int) -> None:
    from flashtune.kernels.config import hopper_support

    from .helpers import run_watched

    reason = hopper_support()
    if reason:
        pytest.skip(f"Hopper kernels cannot run here: {reason}")
    failures = run_watched(__name__, "_hopper_programs", seed, 600.0)
    assert not failures, "\n".join(failures)
