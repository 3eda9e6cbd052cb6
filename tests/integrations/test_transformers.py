"""attn_implementation=ft_hf.NAME on a tiny, randomly initialised Llama (no downloads): one
training step's loss and gradients match "sdpa" on plain, padding-free packed and padded
batches, and flashtune's kernels ran (not the fallback)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashtune.integrations import transformers as ft_hf  # noqa: E402
from flashtune.kernels import _bound  # noqa: E402
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


def _step(model_cls, config_cls, impl, seed, device, ids, batch=None, **kw):
    torch.manual_seed(seed)
    cfg = config_cls(**_tiny_config(**kw))
    model = model_cls._from_config(cfg, attn_implementation=impl, torch_dtype=torch.bfloat16)
    model.to(device).train()
    out = model(**batch) if batch is not None else model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.float().item(), grads, model


def _launches() -> int:
    return _bound.counts["bound"] + _bound.counts["jit"]


def _compare(model_cls, config_cls, device, seed, seqlen=32, batch=None, path="dense",
             ref_batch=None, **kw):
    ft_hf.register()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, seqlen), generator=g).to(device)
    loss_ref, g_ref, _ = _step(model_cls, config_cls, "sdpa", seed, device, ids,
                               ref_batch or batch, **kw)
    # Launches, not the dispatcher's first sights: a padded batch unpads to the packed
    # problem an earlier call already resolved, which is then served without one.
    before, calls = _launches(), dict(ft_hf.calls)
    loss, g_ft, model = _step(model_cls, config_cls, ft_hf.NAME, seed, device, ids, batch, **kw)
    assert model.config._attn_implementation == ft_hf.NAME
    assert _launches() > before, "flashtune's kernels did not run"
    assert ft_hf.calls[path] > calls[path] and ft_hf.calls["fallback"] == calls["fallback"]
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


def _packed_batch(device, seed, flash_kwargs, lengths=(7, 1, 12, 5)):
    """The padding-free batch DataCollatorWithFlattening makes of a few sequences, and the
    same sequences as a right-padded batch (what "sdpa" runs as the reference)."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in lengths]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": s.tolist()} for s in seqs])
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def to(b):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}

    return to(batch), to(padded)


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_llama_padding_free_packed_step_matches_sdpa(device, seed, flash_kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM

    batch, padded = _packed_batch(device, seed, flash_kwargs)
    assert batch["input_ids"].shape[0] == 1
    # transformers' own "sdpa" attends across the packed sequences' boundaries in training
    # mode (its packed-mask detection is off when a cache exists), so the reference runs the
    # same sequences as a padded batch: the same tokens, labels and mean loss.
    _compare(LlamaForCausalLM, LlamaConfig, device, seed, batch=batch, path="packed",
             ref_batch=padded)


def test_llama_padded_step_matches_sdpa(device, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (3, 16), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[2, 11:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    _compare(LlamaForCausalLM, LlamaConfig, device, seed, batch=batch, path="padded")


def test_fallback_warns_once_at_warning(device, seed, caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    ft_hf.register()
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(LlamaConfig(**_tiny_config()),
                                          attn_implementation=ft_hf.NAME,
                                          torch_dtype=torch.float32).to(device).eval()
    ids = torch.randint(0, 128, (1, 8)).to(device)
    ft_hf._fallback_noted.clear()
    with caplog.at_level("WARNING", logger=ft_hf.log.name), torch.no_grad():
        model(input_ids=ids)
        model(input_ids=ids)
    notes = [r for r in caplog.records if "instead of flashtune" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelname == "WARNING"
    assert "float32" in notes[0].getMessage()


def test_a_name_with_flash_is_refused():
    with pytest.raises(ValueError, match="contains 'flash'"):
        ft_hf.register("flashtune")


@pytest.mark.gpu
def test_llama_one_step_matches_sdpa_gpu_longer(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    _compare(LlamaForCausalLM, LlamaConfig, "cuda", seed, seqlen=256)


@pytest.mark.gpu
@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_llama_packed_and_padded_steps_match_sdpa_gpu_longer(seed, flash_kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM

    batch, padded = _packed_batch("cuda", seed, flash_kwargs, lengths=(300, 1, 700, 64, 128))
    _compare(LlamaForCausalLM, LlamaConfig, "cuda", seed, batch=batch, path="packed",
             ref_batch=padded)
    _compare(LlamaForCausalLM, LlamaConfig, "cuda", seed, batch=padded, path="padded")


def test_the_backward_kind_passes_through(device, seed):
    from flashtune.dispatch._state import fast

    q = torch.randn(1, 4, 16, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    k = torch.randn(1, 2, 16, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    for flag in (False, None):  # transformers' kwarg, and its absence (deterministic)
        kw = {} if flag is None else {"deterministic": flag}
        out, _ = ft_hf.attention_forward(torch.nn.Module(), q, k, v, None, **kw)
        out.float().sum().backward()
    kinds = sorted(fk[-1] for fk in fast if fk[0] == "bwd")
    assert kinds == [False, True]
