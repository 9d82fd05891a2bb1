"""The contract every generation backend keeps: what a worker, the judge and the held-out evaluator ask of
an engine, and nothing of how it generates.

A backend is one module: a class that satisfies `RolloutEngine` and a builder registered by name in
`backends.py` (or named by import path in `engine.backend`). Callers hold a `RolloutEngine`, never a
concrete class, and read no attribute outside this protocol.

- **Generation.** `generate_stream(prompts, params, seed, max_new_tokens)` yields lists of `Completion`s
  as they finish; over the iteration each of the `len(prompts) * params.n` samples comes once, with its
  token ids and the log-prob of each under the sampling temperature (`log_softmax(logits / T)` at the
  sampled token, before top-k / top-p: those change which tokens may be drawn, not what is reported).
  The trainer recomputes the same log-probs, so a backend whose numbers drift from them trains off-policy.
  `generate` is the same, collected and ordered prompt-major.
- **Continuation.** `continue_stream(requests, params, seed)` extends sequences the engine produced: each
  `Continuation` holds a sequence's ids so far (the prompt and every earlier turn, token for token as the
  engine returned them) and ids appended after them (a tool's answer, the next user turn); the engine
  reads `prefix + appended` as they are, never re-tokenised, and samples one continuation of each. A
  backend with a prefix cache reuses it for the prefix; one without (ours) prefills the whole sequence
  again, which gives the same tokens and log-probs.
- **Weights.** `load_weights(weights, final, version)` takes `(name, tensor)` pairs, possibly in several
  parts (`final=False` until the last); `load_weights_from_path(path)` reads a Hugging Face folder's
  safetensors. `policy_version` is the update the weights came from (stamped on each completion).
- **Memory.** `state`, `sleep(level)` and `wake()`: "offload" keeps a host copy, "discard" keeps nothing
  (the next `load_weights` refills it), as `models/residency.py` for the other models of a device.
- **Statistics (optional).** `take_stats()` returns what the calls since the last take did
  (`EngineStats`: decode rounds with their batch sizes and seconds, prefilled and generated tokens), or
  None for a backend that does not count; the caller then counts from the completions it received
  (`counted_stats`), without the rounds that dynamic placement's engine fit needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch

from gcore_rl.records import Completion, VisionPrompt, prompt_images
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.rollout.stats import EngineStats

EngineState = Literal["awake", "offloaded", "discarded"]


@dataclass(frozen=True)
class Continuation:
    """One sequence to continue: its ids so far (`prefix`: prompt + earlier turns, a `VisionPrompt` keeps its
    images) and the ids appended after them (`appended`: tool output, a user turn), at most
    `max_new_tokens` new tokens."""

    prefix: Sequence[int]
    appended: Sequence[int]
    max_new_tokens: int

    @property
    def prompt(self) -> Sequence[int]:
        """What the engine reads: `prefix + appended` (with the prefix's images)."""
        ids = [*self.prefix, *self.appended]
        images = prompt_images(self.prefix)
        return ids if images is None else VisionPrompt(ids, images)


def continuation_inputs(requests: Sequence[Continuation], params: SamplingConfig,
                        ) -> tuple[list[Sequence[int]], SamplingConfig, list[int]]:
    """The plain generate call a continuation is: one sample of each request's `prompt` with its own token
    limit. A backend without a prefix cache implements `continue_stream` as `generate_stream` of these."""
    return [r.prompt for r in requests], replace(params, n=1), [r.max_new_tokens for r in requests]


def prompt_major(stream: Iterable[list[Completion]]) -> list[Completion]:
    """Every completion of a `generate_stream`, ordered prompt-major (what `generate` returns)."""
    return sorted((c for finished in stream for c in finished), key=lambda c: (c.prompt_index, c.sample_index))


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation backend (see the module docstring for the contract of each method)."""

    policy_version: int
    state: EngineState

    def generate_stream(self, prompts: Sequence[Sequence[int]], params: SamplingConfig, seed: int | None = None,
                        max_new_tokens: Sequence[int] | None = None) -> Iterator[list[Completion]]:
        """`params.n` samples of every prompt, yielded in lists as they finish (prompt indices into `prompts`)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingConfig, seed: int | None = None,
                 max_new_tokens: Sequence[int] | None = None) -> list[Completion]:
        """All samples of `generate_stream`, prompt-major (rows i*n .. i*n+n-1 are prompt i's)."""
        ...

    def continue_stream(self, requests: Sequence[Continuation], params: SamplingConfig,
                        seed: int | None = None) -> Iterator[list[Completion]]:
        """One continuation of each request (`prompt_index` = the request's index, `prompt_ids` = its
        `prompt`, `token_ids` only the new tokens), yielded as they finish; `params.n` is ignored."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], final: bool = True,
                     version: int | None = None) -> int:
        """Copy `(name, tensor)` pairs into the served model; `final` ends the update. Returns tensors loaded."""
        ...

    def load_weights_from_path(self, path: str | Path, version: int | None = None) -> int:
        """Load every tensor of the safetensors files of the folder `path` as one update."""
        ...

    def sleep(self, level: Literal["offload", "discard"] = "offload") -> int:
        """Release device memory; the bytes released (0 when already asleep)."""
        ...

    def wake(self) -> None:
        """Bring the weights back (a discarded engine then needs `load_weights` before it generates)."""
        ...

    def take_stats(self) -> EngineStats | None:
        """The statistics of the calls since the last take (then reset), or None when the backend keeps none."""
        ...

    def save_pretrained(self, path: str | Path) -> None:
        """Write the weights it serves (and their model config) as a Hugging Face folder, without a tokenizer."""
        ...
