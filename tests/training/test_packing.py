"""Packed forward passes equal padded ones (issue 21, item 1)."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.models.tiny import TinyModelConfig, build_tiny_model
from gcore_rl.training.logprobs import token_logprobs
from gcore_rl.training.packing import pack_rows, packed_token_logprobs


def test_pack_rows_keeps_each_rows_tokens_in_order_with_restarting_positions():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 10, 11, 12, 13], [0, 14, 15, 0, 0, 0]])
    mask = (ids != 0).long()
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1]]
    assert packed.rows.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2]
    assert packed.cols.tolist() == [2, 3, 4, 0, 1, 2, 3, 4, 5, 1, 2]


def _batch(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A TokenBatch-like layout: prompts left-padded to column 6, completions of 1..10 tokens right-padded."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths, completion_lengths = [6, 2, 4, 1, 5], [10, 3, 1, 7, 5]
    ids = torch.zeros(len(prompt_lengths), 16, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        mask[row, 6 - p:6 + c] = 1
    ids[mask.bool()] = torch.randint(3, vocab, (int(mask.sum()),), generator=gen)
    return ids, mask, 6


@pytest.mark.parametrize("arch, attention", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_ones(arch, attention, temperature):
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                             intermediate_size=64, arch=arch), 40, 0, 1)
    model.config._attn_implementation = attention
    ids, mask, first = _batch(1, 40)
    scored = mask.bool() & (torch.arange(ids.shape[1]) >= first)

    def run(fn):
        model.zero_grad()
        logprobs, entropy = fn(model, ids, mask, temperature, with_entropy=True, entropy_grad=True, first_scored=first)
        (logprobs[scored].sum() + 0.1 * entropy[scored].sum()).backward()
        return logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    padded, packed = run(token_logprobs), run(packed_token_logprobs)
    # fp32 forward of a 2-layer model: rounding differences of a few ulp of the logits (~1e-6)
    torch.testing.assert_close(packed[0][scored], padded[0][scored], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[1][scored], padded[1][scored], rtol=0, atol=1e-5)
    assert not packed[0][~scored].any() and not packed[1][~scored].any()  # nothing scored outside the responses
    for name, grad in padded[2].items():
        torch.testing.assert_close(packed[2][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_tokens_of_one_row_do_not_see_another_row():
    """Changing row 0's tokens leaves row 1's packed log-probs exactly as they were."""
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                             intermediate_size=64), 40, 0, 1)
    ids, mask, first = _batch(2, 40)
    before, _ = packed_token_logprobs(model, ids, mask, first_scored=first)
    changed = ids.clone()
    changed[0][mask[0].bool()] = 7
    after, _ = packed_token_logprobs(model, changed, mask, first_scored=first)
    torch.testing.assert_close(after[1:], before[1:], rtol=0, atol=1e-6)  # leakage would move them by far more
    assert not torch.equal(after[0], before[0])
