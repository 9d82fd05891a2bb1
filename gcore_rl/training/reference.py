"""The frozen reference model on a device of its own: its log-probs of a wave's completions in the
rollout phase (the `interleave` strategy), while the reward models score the same wave elsewhere.

Under every other strategy the reference is a shard next to the actor (`PolicyTrainer.reference`)
and runs in the update phase. Here it is a whole model, unsharded, that sleeps in host memory when
its device generates or trains (`HostOffload`). Its log-probs are computed as the trainer computes
them: the same `compute_logprobs` (left-padded prompts with explicit position ids, the sampling's
`logprob_temperature`) and, in bf16 mixed precision (`train.bf16`; on a CPU with `train.bf16_cpu`), the same bf16 autocast the actor runs under.
What can still differ is floating-point noise: another batch layout, and on CUDA the sharded
reference's bf16 parameter gathers against this model's own weights. On CPU the KL to it before the
first update is exactly 0 in the Ray test.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from gcore_rl.models.residency import HostOffload
from gcore_rl.records import Completion, build_token_batch
from gcore_rl.training.actor import compute_logprobs
from gcore_rl.training.micro_batches import MicroBatching


class ReferenceScorer(HostOffload):
    """Reference log-probs of completions.

    Args:
        model: the frozen causal LM (no grad), on `device`.
        temperature: `sampling.logprob_temperature`, as the trainer uses it.
        batching: the forward passes (the actor's `TrainConfig.batching`).
        pad_id: the tokenizer's pad id.
        bf16: run the forward under bf16 autocast (`train.bf16_on(device)`, as the actor does).
    """

    def __init__(self, model: nn.Module, *, temperature: float, batching: MicroBatching, pad_id: int, device: torch.device,
                 bf16: bool = False):
        model.requires_grad_(False)
        self.model = model
        self.temperature = temperature
        self.batching = batching
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.bf16 = bf16
        self.state = "awake"

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def logprobs(self, completions: list[Completion]) -> list[list[float]]:
        """For each completion (input order), the reference's log-prob of each of its tokens."""
        if self.state != "awake":
            raise RuntimeError("the reference is asleep (offloaded); call wake() first")
        if not completions:
            return []
        batch = build_token_batch(completions, self.pad_id)
        values = compute_logprobs(self.model, batch, self.temperature, self.batching, self.device, self._autocast)
        start = max(len(c.prompt_ids) for c in completions)  # completions start at the same column
        return [values[row, start:start + len(c.token_ids)].tolist() for row, c in enumerate(completions)]
