"""The mismatch correction reaches the actor's loss: MIS drops a row the engine sampled far off the trainer's policy."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from gcore_rl.records import Completion, build_token_batch
from gcore_rl.training.actor import Actor, TrainConfig, compute_logprobs

CPU = torch.device("cpu")
TOKENIZER = build_char_tokenizer()


def _actor(**algo) -> Actor:
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
                             len(TOKENIZER), TOKENIZER.pad_token_id, TOKENIZER.eos_token_id)
    return Actor(model, TrainConfig(grad_clip=0.0), AlgoConfig(**algo).resolved(max_new_tokens=4), temperature=1.0, device=CPU)


def _batch(actor: Actor, advantages: list[float], engine_offset: float):
    """Two completions; the engine's log-probs are the trainer's + `engine_offset` on row 0 (ratio e^-offset)."""
    completions = [Completion(prompt_index=i, sample_index=0, prompt_ids=TOKENIZER.encode(p, add_special_tokens=False),
                              token_ids=TOKENIZER.encode(a, add_special_tokens=False), logprobs=[0.0] * len(a), finish_reason="stop")
                   for i, (p, a) in enumerate((("1+2=", "3"), ("2+2=", "4")))]
    batch = build_token_batch(completions, TOKENIZER.pad_token_id)
    batch.rollout_logprobs = compute_logprobs(actor.model, batch, 1.0, 8, CPU)
    batch.rollout_logprobs[0] += engine_offset * batch.response_mask[0]
    batch.advantages = torch.tensor(advantages)
    return batch


def test_mis_masks_the_far_off_row_and_reports_the_mismatch():
    corrected, reference = _actor(mismatch_correction="mis", mismatch_cap=2.0), _actor()
    # row 0: engine log-prob = trainer's + ln 4, ratio 1/4 < 1/C: MIS gives it weight 0; row 1 agrees (ratio 1, weight 1)
    stats = corrected.update(_batch(corrected, [1.0, -1.0], engine_offset=float(torch.tensor(4.0).log())))
    # the same update without a correction, row 0's advantage 0 and no mismatch: the same loss and the same step
    reference.update(_batch(reference, [0.0, -1.0], engine_offset=0.0))
    for (name, after), (_, expected) in zip(corrected.model.named_parameters(), reference.model.named_parameters(), strict=True):
        torch.testing.assert_close(after, expected, msg=lambda detail, name=name: f"{name}: {detail}")
    assert stats["mismatch/masked_fraction"] > 0 and stats["mismatch/ratio_max"] == pytest.approx(1.0)
    assert stats["mismatch/kl_k1"] > 0
