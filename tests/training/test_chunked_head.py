"""The chunked LM head (issue 46): log-probs, entropy and gradients equal to the full-logits path, no `[tokens, V]` tensor."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from gcore_rl.algos.kl import entropy_from_logits
from gcore_rl.models.tiny import TinyModelConfig, build_tiny_model
from gcore_rl.training import chunked_head as ch
from gcore_rl.training import logprobs as lp
from gcore_rl.training.fsdp import shard_model
from gcore_rl.training.packing import packed_token_logprobs

VOCAB = 40
BANNED = [5, 17, 33]


def _reference(hidden, weight, bias, targets, temperature, banned):
    """The naive fp64 formula: `log_softmax(logits / T)` at the targets and the entropy, over the vocabulary
    without the banned ids (the same distribution as theirs at −inf, without −inf in the graph)."""
    logits = torch.nn.functional.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    kept = torch.ones(logits.shape[-1], dtype=torch.bool)
    if banned is not None:
        kept[banned] = False
    column = kept.long().cumsum(0) - 1  # a kept id's column among the kept ones
    scaled = logits[:, :-1, kept] / temperature
    logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, column[targets].unsqueeze(-1)).squeeze(-1)
    return logprobs, entropy_from_logits(scaled)


@pytest.mark.parametrize("temperature, banned, with_bias", [(1.0, None, False), (0.7, BANNED, True)])
def test_chunked_head_matches_the_formula_in_value_and_gradient(temperature, banned, with_bias, monkeypatch):
    monkeypatch.setattr(ch, "CHUNK_POSITIONS", 5)  # 18 positions: four chunks, the last one partial
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 6, generator=gen, requires_grad=True)
    weight = torch.randn(11 if banned is None else VOCAB, 6, generator=gen, requires_grad=True)
    bias = torch.randn(weight.shape[0], generator=gen, requires_grad=True) if with_bias else None
    allowed = [t for t in range(weight.shape[0]) if t not in (banned or [])]
    targets = torch.tensor(allowed)[torch.randint(0, len(allowed), (3, 6), generator=gen)]
    w_logprob, w_entropy = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    banned_ids = None if banned is None else torch.tensor(banned)
    inputs = [t for t in (hidden, weight, bias) if t is not None]

    logprobs, entropy = ch.ChunkedHeadLogprob.apply(hidden, weight, bias, targets, temperature, banned_ids)
    grads = torch.autograd.grad((logprobs * w_logprob).sum() + (entropy * w_entropy).sum(), inputs)
    ref_logprobs, ref_entropy = _reference(hidden, weight, bias, targets, temperature, banned_ids)
    ref_grads = torch.autograd.grad((ref_logprobs * w_logprob).sum() + (ref_entropy * w_entropy).sum(), inputs)

    torch.testing.assert_close(logprobs.double(), ref_logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=1e-5)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=0, atol=1e-5)
    assert torch.all(grads[0][:, -1] == 0)  # the last position scores nothing
    if banned is not None:  # a banned id is never chosen: its row of the weight gets no gradient
        assert torch.all(grads[1][banned_ids] == 0)


def _untied_biased_model() -> nn.Module:
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = LlamaForCausalLM(config)
    model.lm_head = nn.Linear(32, VOCAB, bias=True)
    return model


def _tied_model(arch: str = "llama") -> nn.Module:
    cfg = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, arch=arch)
    model = build_tiny_model(cfg, VOCAB, 0, 1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompts left-padded to column 5, completions of 1..8 tokens right-padded, ids never banned."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(4, 13, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate([(5, 8), (2, 3), (4, 1), (1, 6)]):
        mask[row, 5 - prompt:5 + completion] = 1
    allowed = torch.tensor([t for t in range(2, VOCAB) if t not in BANNED])
    ids[mask.bool()] = allowed[torch.randint(0, len(allowed), (int(mask.sum()),), generator=gen)]
    return ids, mask, 5


def _pass(model: nn.Module, fn, chunked: bool, temperature: float, monkeypatch):
    """Log-probs, entropy and every parameter's gradient of a loss weighting both, on one path."""
    monkeypatch.setattr(lp, "CHUNKED_HEAD", chunked)
    ids, mask, first = _batch()
    scored = mask.bool() & (torch.arange(ids.shape[1]) >= first)  # response tokens (padding is scored, unused)
    model.zero_grad()
    logprobs, entropy = fn(model, ids, mask, temperature, with_entropy=True, entropy_grad=True, first_scored=first)
    weights = torch.linspace(-1.0, 1.0, int(scored.sum()))
    (logprobs[scored] @ weights + 0.3 * entropy[scored].sum()).backward()
    grads = {name: _full(param.grad) for name, param in model.named_parameters()}
    return logprobs.detach()[scored], entropy.detach()[scored], grads


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


def _assert_paths_agree(chunked, full) -> None:
    torch.testing.assert_close(chunked[0], full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked[1], full[1], rtol=0, atol=1e-5)
    assert full[2].keys() == chunked[2].keys()
    for name, grad in full[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("build", [_tied_model, _untied_biased_model], ids=["tied", "untied-bias"])
@pytest.mark.parametrize("fn", [lp.token_logprobs, packed_token_logprobs], ids=["padded", "packed"])
def test_chunked_head_equals_the_full_logits_path(build, fn, monkeypatch):
    monkeypatch.setattr(ch, "CHUNK_POSITIONS", 4)
    monkeypatch.setattr(lp, "banned_ids", lambda model, device: torch.tensor(BANNED, device=device))
    model = build()
    _assert_paths_agree(_pass(model, fn, True, 0.8, monkeypatch), _pass(model, fn, False, 0.8, monkeypatch))


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("build", [_tied_model, _untied_biased_model], ids=["tied", "untied-bias"])
def test_chunked_head_under_fsdp2_equals_the_full_logits_path(build, monkeypatch):
    """Sharded (world of one): the head's weight is the root's, gathered only in the root's forward and backward."""
    monkeypatch.setattr(ch, "CHUNK_POSITIONS", 4)
    monkeypatch.setattr(lp, "banned_ids", lambda model, device: torch.tensor(BANNED, device=device))
    plain = build()
    expected = _pass(plain, lp.token_logprobs, False, 0.7, monkeypatch)
    model = shard_model(copy.deepcopy(plain))
    for _ in range(2):  # twice: the second pass runs on parameters resharded after the first backward
        _assert_paths_agree(_pass(model, lp.token_logprobs, True, 0.7, monkeypatch), expected)
    _assert_paths_agree(_pass(model, packed_token_logprobs, True, 0.7, monkeypatch),
                        _pass(model, packed_token_logprobs, False, 0.7, monkeypatch))


def test_bf16_autocast_scores_in_fp32_and_gives_gradients_of_the_parameters_dtypes(monkeypatch):
    model = _untied_biased_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = _pass(model, lp.token_logprobs, True, 1.0, monkeypatch)
        full = _pass(model, lp.token_logprobs, False, 1.0, monkeypatch)
    assert chunked[0].dtype == chunked[1].dtype == torch.float32
    # both paths score the same bf16 logits in fp32
    torch.testing.assert_close(chunked[0], full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked[1], full[1], rtol=0, atol=1e-5)
    for name, grad in full[2].items():
        assert chunked[2][name].dtype == grad.dtype == torch.float32
        # the backward's bf16 products round at other points (a few bf16 ulps, 2^-8 each, of the largest entry)
        assert float((chunked[2][name] - grad).abs().max()) <= 2**-5 * float(grad.abs().max()), name


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.most = max(self.most, tensor.numel())
        return out


@pytest.mark.parametrize("chunked", [True, False])
def test_no_tensor_of_tokens_times_vocabulary_is_made(chunked, monkeypatch):
    """At V = 4,096 ≫ H = 32 no op of the chunked forward + backward returns a `[tokens, V]` tensor (the full
    path does: the check can see one)."""
    vocab = 4096
    monkeypatch.setattr(ch, "CHUNK_POSITIONS", 8)
    monkeypatch.setattr(lp, "CHUNKED_HEAD", chunked)
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                             intermediate_size=64, vocab_size=vocab), VOCAB, 0, 1)
    ids = torch.randint(2, vocab, (4, 16), generator=torch.Generator().manual_seed(0))
    tokens = ids.numel() - ids.shape[0]  # scored positions
    with _LargestTensor() as largest:
        logprobs, entropy = lp.token_logprobs(model, ids, torch.ones_like(ids), 0.9, with_entropy=True)
        logprobs.sum().backward()
    assert (largest.most < tokens * vocab) == chunked, (largest.most, tokens * vocab)
    if chunked:  # the largest is the weight's gradient (or the embedding's), V × H
        assert largest.most <= max(vocab * 32, 8 * vocab)


class _SoftCapped(nn.Module):
    """A causal LM whose forward changes the head's output after the call, as Gemma's soft-capping does."""

    def __init__(self, soft_cap: float | None) -> None:
        super().__init__()
        self.config = LlamaConfig(vocab_size=VOCAB, final_logit_softcapping=soft_cap)
        self.embed = nn.Embedding(VOCAB, 8)
        self.lm_head = nn.Linear(8, VOCAB, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids, logits_to_keep, **kwargs):
        logits = self.lm_head(self.embed(input_ids)[:, -logits_to_keep:])
        return type("Output", (), {"logits": 30.0 * torch.tanh(logits / 30.0)})


def test_a_model_that_changes_the_heads_output_keeps_the_full_logits_path_or_is_refused():
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, logits_to_keep=4)
    capped = _SoftCapped(30.0)  # its config says so: the full-logits path
    assert not ch.head_is_plain(capped)
    logprobs, _ = lp.scored_logprobs(capped, inputs, ids[:, 3:])
    logits = capped(**inputs).logits.detach()
    torch.testing.assert_close(logprobs, _reference(logits, torch.eye(VOCAB), None, ids[:, 3:], 1.0, None)[0].float())
    silent = _SoftCapped(None)  # its config does not: refused rather than scored wrong
    assert ch.head_is_plain(silent)
    with pytest.raises(RuntimeError, match="changed the LM head's output"):
        lp.scored_logprobs(silent, inputs, ids[:, 3:])
    assert "forward" not in silent.lm_head.__dict__  # the head is restored after a failed pass too
