"""Per-token log-probs and entropies of a causal LM over a `TokenBatch` layout."""

from __future__ import annotations

import torch
from torch import nn

from gcore_rl.algos.kl import entropy_from_logits


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given the tokens before it.

    Args: input_ids, attention_mask `[B, T]` (any mix of left and right padding).
    Returns (logprobs `[B, T]` fp32 with column 0 = 0, entropy `[B, T]` or None), computed from
    logits / temperature exactly as the engine samples.
    """
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits
    logits = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:]
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.nn.functional.pad(logprobs, (1, 0))
    entropy = None
    if with_entropy:
        entropy = torch.nn.functional.pad(entropy_from_logits(logits), (1, 0))
    return logprobs, entropy
