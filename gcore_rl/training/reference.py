"""The frozen reference model on a device of its own: its log-probs of a wave's completions in the
rollout phase (the `interleave` strategy), while the reward models score the same wave elsewhere.

Under every other strategy the reference is a shard next to the actor (`PolicyTrainer.reference`)
and runs in the update phase. Here it is a whole model, unsharded, that sleeps in host memory when
its device generates or trains (`HostOffload`). Its log-probs are those the trainer would compute:
the same `compute_logprobs` (left-padded prompts with explicit position ids, the sampling's
`logprob_temperature`), so only floating-point noise of a different batch layout separates them.
"""

from __future__ import annotations

import torch
from torch import nn

from gcore_rl.models.residency import HostOffload
from gcore_rl.records import Completion, build_token_batch
from gcore_rl.training.actor import compute_logprobs


class ReferenceScorer(HostOffload):
    """Reference log-probs of completions.

    Args:
        model: the frozen causal LM (no grad), on `device`.
        temperature: `sampling.logprob_temperature`, as the trainer uses it.
        micro_batch_size: rows per forward pass.
        pad_id: the tokenizer's pad id.
    """

    def __init__(self, model: nn.Module, *, temperature: float, micro_batch_size: int, pad_id: int, device: torch.device):
        model.requires_grad_(False)
        self.model = model
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.state = "awake"

    def logprobs(self, completions: list[Completion]) -> list[list[float]]:
        """For each completion (input order), the reference's log-prob of each of its tokens."""
        if self.state != "awake":
            raise RuntimeError("the reference is asleep (offloaded); call wake() first")
        if not completions:
            return []
        batch = build_token_batch(completions, self.pad_id)
        values = compute_logprobs(self.model, batch, self.temperature, self.micro_batch_size, self.device)
        start = max(len(c.prompt_ids) for c in completions)  # completions start at the same column
        return [values[row, start:start + len(c.token_ids)].tolist() for row, c in enumerate(completions)]
