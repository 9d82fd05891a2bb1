"""The fused selected-token log-prob: values, entropy and gradient against the naive autograd formula."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.algos.kl import entropy_from_logits
from gcore_rl.training import logprobs as lp


def _naive(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    scaled = logits[:, :-1].double() / temperature
    logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logprobs, entropy_from_logits(scaled)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selected_logprob_matches_log_softmax_in_value_and_gradient(temperature, monkeypatch):
    monkeypatch.setattr(lp, "CHUNK_ROWS", 5)  # several chunks, the last one partial
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 11, generator=gen)).requires_grad_(True)
    targets = torch.randint(0, 11, (3, 6), generator=gen)
    weights = torch.randn(3, 6, generator=gen)

    fused, entropy = lp.SelectedLogprob.apply(logits, targets, temperature)
    (fused * weights).sum().backward()
    grad_fused = logits.grad.clone()

    reference = logits.detach().double().requires_grad_(True)
    naive, naive_entropy = _naive(reference, targets, temperature)
    (naive * weights.double()).sum().backward()

    torch.testing.assert_close(fused.double(), naive, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), naive_entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_fused.double(), reference.grad, rtol=0, atol=1e-6)
    assert torch.all(grad_fused[:, -1] == 0)  # the last position scores nothing


def test_masked_vocabulary_entries_give_finite_values():
    logits = torch.tensor([[[0.0, float("-inf"), 1.0], [2.0, 0.0, float("-inf")]]], requires_grad=True)
    targets = torch.tensor([[2]])
    value, entropy = lp.SelectedLogprob.apply(logits, targets, 1.0)
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()
    assert float(value.detach()) == pytest.approx(1.0 - float(torch.logsumexp(torch.tensor([0.0, 1.0]), 0)))


def test_scoring_from_the_first_response_column_changes_nothing_there():
    """`first_scored` skips the LM head on prompt columns; the response columns' values are unchanged."""
    from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64), len(tokenizer),
                             tokenizer.pad_token_id, tokenizer.eos_token_id).eval()
    ids = torch.randint(3, len(tokenizer), (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    response = torch.zeros_like(ids)
    response[:, 5:] = 1
    first = lp.first_response_column(response)
    assert first == 5 and lp.first_response_column(torch.zeros_like(ids)) == 1
    with torch.no_grad():
        full, full_entropy = lp.token_logprobs(model, ids, mask, 0.8, with_entropy=True)
        part, part_entropy = lp.token_logprobs(model, ids, mask, 0.8, with_entropy=True, first_scored=first)
    torch.testing.assert_close(part[:, first:], full[:, first:], rtol=0, atol=1e-6)
    torch.testing.assert_close(part_entropy[:, first:], full_entropy[:, first:], rtol=0, atol=1e-6)
    assert torch.all(part[:, :first] == 0)
