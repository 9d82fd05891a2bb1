"""Batches the critic tests share (tests/training/test_critic.py, test_critic_apart.py)."""

from __future__ import annotations

import torch

from gcore_rl.records import Completion, TokenBatch, build_token_batch


def ragged_batch(tokenizer, rewards: list[float], seed: int = 0) -> TokenBatch:
    """One row per reward, of ragged prompt and completion lengths drawn from `seed`, with those outcome
    rewards (a fresh object each call)."""
    gen = torch.Generator().manual_seed(seed)
    completions = []
    for i, _ in enumerate(rewards):
        prompt = tokenizer.encode(f"{4 * i + seed}+{i}=" + "x" * (i % 2), add_special_tokens=False)
        tokens = torch.randint(3, len(tokenizer), (2 + (i * 3 + seed) % 4,), generator=gen).tolist()
        completions.append(Completion(i, prompt, tokens, [0.0] * len(tokens), "length"))
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    batch.rewards = torch.tensor(rewards)
    return batch
