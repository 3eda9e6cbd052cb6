"""attn_implementation="flashtune" on a tiny, randomly initialised Llama (no downloads):
one training step's loss and gradients match "sdpa"."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashtune import dispatch  # noqa: E402
from flashtune.integrations import transformers as ft_hf  # noqa: E402
from tests.dispatch.test_dispatch import fresh_db  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dispatch(tmp_path, monkeypatch):
    yield from fresh_db(tmp_path, monkeypatch)


def _tiny_config(**kw):
    base = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
    base.update(kw)
    return base


def _step(model_cls, config_cls, impl, seed, device, ids, **kw):
    torch.manual_seed(seed)
    cfg = config_cls(**_tiny_config(**kw))
    model = model_cls._from_config(cfg, attn_implementation=impl, torch_dtype=torch.bfloat16)
    model.to(device).train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.float().item(), grads, model


def _compare(model_cls, config_cls, device, seed, seqlen=32, **kw):
    ft_hf.register()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, seqlen), generator=g).to(device)
    loss_ref, g_ref, _ = _step(model_cls, config_cls, "sdpa", seed, device, ids, **kw)
    before = dispatch.stats()["first_sights"]
    loss, g_ft, model = _step(model_cls, config_cls, "flashtune", seed, device, ids, **kw)
    assert model.config._attn_implementation == "flashtune"
    assert dispatch.stats()["first_sights"] > before, "flashtune's kernels did not run"
    assert abs(loss - loss_ref) < 2e-2 * max(1.0, abs(loss_ref)), (loss, loss_ref)
    assert g_ft.keys() == g_ref.keys()
    for name, ref in g_ref.items():
        got = g_ft[name]
        assert torch.isfinite(got).all(), name
        # bf16 model end to end: compare gradients by relative norm of the difference.
        err = (got - ref).norm() / ref.norm().clamp_min(1e-6)
        assert err < 5e-2, f"{name}: relative gradient error {err:.3g}"


def test_llama_one_step_matches_sdpa(device, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    _compare(LlamaForCausalLM, LlamaConfig, device, seed)


def test_mistral_sliding_window_matches_sdpa(device, seed):
    from transformers import MistralConfig, MistralForCausalLM

    # Sliding window 8 over 32 tokens: the window really cuts.
    _compare(MistralForCausalLM, MistralConfig, device, seed, sliding_window=8)


def test_padding_falls_back_to_sdpa_semantics(device, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    ft_hf.register()
    torch.manual_seed(seed)
    ids = torch.randint(0, 128, (2, 16)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding in the first row
    outs = []
    for impl in ("sdpa", "flashtune"):
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(LlamaConfig(**_tiny_config()),
                                              attn_implementation=impl,
                                              torch_dtype=torch.bfloat16).to(device).eval()
        with torch.no_grad():
            outs.append(model(input_ids=ids, attention_mask=mask).logits.float())
    real = mask.bool()
    torch.testing.assert_close(outs[1][real], outs[0][real], atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_llama_one_step_matches_sdpa_gpu_longer(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    _compare(LlamaForCausalLM, LlamaConfig, "cuda", seed, seqlen=256)
