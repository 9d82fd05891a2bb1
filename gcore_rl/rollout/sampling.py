"""Sampling parameters and the per-step token sampler of the generation engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gcore_rl.errors import ConfigError


@dataclass
class SamplingConfig:
    """How completions are drawn from the policy."""

    n: int = field(default=8, metadata={"help": "Completions sampled per prompt (the GRPO group size)."})
    max_new_tokens: int = field(default=8, metadata={"help": "Longest completion; longer ones stop with finish_reason 'length'."})
    temperature: float = field(default=1.0, metadata={"help": "Softmax temperature; 0 means greedy. The trainer divides logits by the same value."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: keep the smallest token set whose probability reaches top_p (1 = off)."})
    top_k: int = field(default=0, metadata={"help": "Keep only the k most likely tokens (0 = off)."})
    ignore_eos: bool = field(default=False, metadata={"help": "Keep sampling after EOS until max_new_tokens (benchmarks and load tests only)."})

    def validate(self) -> None:
        if self.n < 1:
            raise ConfigError("n", f"must be at least 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError("top_k", f"must be >= 0, got {self.top_k}")

    @property
    def logprob_temperature(self) -> float:
        """Temperature used for reported log-probs (greedy decoding reports the T=1 distribution)."""
        return self.temperature if self.temperature > 0 else 1.0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k / nucleus sets with -inf.

    Args: logits `[A, V]` (already divided by the temperature). Returns `[A, V]`.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, params: SamplingConfig, generator: torch.Generator | None,
                  uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return it with its log-prob.

    Args: logits `[A, V]` raw next-token logits; `uniforms` `[A]` in [0, 1), one per row, to draw with instead of
    `generator` (a row's own draw, `engine.seeding=row`). Returns (tokens `[A]` long, logprobs `[A]` fp32),
    the log-probs taken from log_softmax(logits / T) before top-k/top-p filtering.

    Sampling inverts each row's cumulative distribution at one uniform draw (`searchsorted`), which
    on CPU is ~40× cheaper than `torch.multinomial` or an exponential race over a 32k vocabulary.
    """
    scaled = logits.float() / params.logprob_temperature
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    if params.temperature == 0:
        tokens = torch.argmax(scaled, dim=-1)
    else:
        if params.top_k > 0 or params.top_p < 1.0:
            probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
        else:
            probs = logprobs_all.exp()
        tokens = inverse_cdf_sample(probs, generator, uniforms)
    return tokens, logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None,
                       uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `probs` `[A, V]` (rows need not sum exactly to 1); returns `[A]` long.

    Picks the first token whose cumulative mass exceeds `u · total` with `u ~ U[0, 1)` (drawn from `generator`, or
    the row's entry of `uniforms` `[A]`), so a token of
    zero probability is never chosen; should rounding push the draw to the total, the row's last token
    of nonzero probability (where the cumulative mass first reaches the total) is taken. No value is read
    back to the host.
    """
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:].contiguous()
    draw = (torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=probs.dtype)
            if uniforms is None else uniforms.to(probs.dtype)[:, None])
    tokens = torch.searchsorted(cumulative, draw * total, right=True)
    return torch.minimum(tokens, torch.searchsorted(cumulative, total)).squeeze(-1)
