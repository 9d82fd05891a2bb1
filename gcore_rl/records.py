"""Typed records that pass between roles (engine → rewards → trainer) and between processes."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """The images of one prompt, as a vision-language model reads them (its image processor's output).

    `pixel_values` `[P, D]`: the patches of all the prompt's images, image after image (D = channels ×
    temporal patch × patch²); `grid_thw` `[I, 3]` long: each image's patch grid (time, height, width).
    The prompt's token ids hold `Π grid_thw[i] / merge²` image tokens for image i, in the same order.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.grid_thw.shape[0])

    @staticmethod
    def concat(parts: Sequence[ImageInputs]) -> ImageInputs:
        """The images of several prompts as one input (pixel rows and grids in the given order)."""
        return ImageInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.grid_thw for p in parts]))


class TokenPrompt(Sequence[int]):
    """A prompt's token ids as a `Sequence[int]`, so it goes wherever a token list goes, for prompts that carry
    something more (`VisionPrompt`, `EpisodePrompt`); everything that reads only tokens sees only them."""

    __slots__ = ("token_ids",)

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = tuple(int(t) for t in token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, index):  # type: ignore[override]
        return self.token_ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.token_ids)


class VisionPrompt(TokenPrompt):
    """A prompt's token ids that also carry the prompt's images (`ImageInputs`).

    The engine reads the images when it prefills the prompt, the trainer when it recomputes log-probs;
    everything else (lengths, padding, `Completion.prompt_ids`) sees only the tokens.
    """

    __slots__ = ("images",)

    def __init__(self, token_ids: Sequence[int], images: ImageInputs):
        super().__init__(token_ids)
        self.images = images

    def __repr__(self) -> str:
        return f"VisionPrompt({len(self.token_ids)} tokens, {self.images.count} images)"

    def __reduce__(self):
        return (VisionPrompt, (self.token_ids, self.images))


class EpisodePrompt(TokenPrompt):
    """A prompt's token ids that also carry the `env` spec of its data row: the environment episode the prompt
    opens (`gcore_rl.agents.environments`), which an environment rollout function resets from. It equals any
    sequence of the same tokens."""

    __slots__ = ("env",)

    def __init__(self, token_ids: Sequence[int], env: dict[str, Any]):
        super().__init__(token_ids)
        self.env = env

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EpisodePrompt({len(self.token_ids)} tokens, env {self.env.get('name')!r})"

    def __reduce__(self):
        return (EpisodePrompt, (self.token_ids, self.env))


def prompt_images(prompt: Sequence[int]) -> ImageInputs | None:
    """The images a prompt carries (None for a plain token list)."""
    return prompt.images if isinstance(prompt, VisionPrompt) else None


@dataclass(frozen=True)
class RewardInput:
    """One sample to score: its prompt text, the decoded completion (a diffusion policy's: the image as a
    ``[H, W, 3]`` float array in [0, 1]) and the full prompt row."""

    prompt: str
    completion: Any
    row: dict


@dataclass(frozen=True)
class Verdict:
    """What one reward model said about one sample: a judge's parsed verdict, or a scalar model's score.

    For a judge, `score` is the raw parsed number (before clamping) or None; `reward` is the clamped score
    scaled to [0, 1], or the config's `unparsed_score` when `parsed` is False; `text` is the verdict;
    `prompt_tokens` / `tokens` the work the judge did for it (what dynamic placement's replay prices).
    A model that only scores (`of_score`) gives its score as both `score` and `reward`.
    """

    score: float | None
    reward: float
    parsed: bool
    text: str
    prompt_tokens: int = 0  # judge-prompt tokens the judge read (0: not counted)
    tokens: int = 0  # tokens the judge generated for this verdict (0: not counted)

    @classmethod
    def of_score(cls, score: float) -> Verdict:
        """The verdict of a model that scores without generating (a scalar reward model): `score` is the reward."""
        return cls(score=score, reward=score, parsed=True, text="")


@dataclass
class Completion:
    """One sampled completion of one prompt, as the engine returns it.

    `logprobs[i]` is log p(token_ids[i] | prompt, token_ids[:i]) under the sampling temperature
    (top-k / top-p change which tokens may be drawn, not the reported log-probs). `loss_mask[i]` is 1 when
    the policy sampled token i and 0 when a rollout function inserted it (a tool's output, a user turn:
    context the policy reads but is not trained on; its log-prob is 0); None means every token is the
    policy's (single-turn generation). `rollout_stats` are per-sample counts a rollout function reports
    (a tool-using one: turns, tool calls, tool errors, tool seconds); the step records their means.
    `turn_rewards` are the rewards an environment gave (`gcore_rl.agents.env_turns`), each at the index of the
    last token of the assistant turn it rewards; they join the sample's reward (`environment_reward`) and,
    under GAE, are placed at those tokens.
    `sample_index` is which of the prompt's n samples this is; `policy_version` counts the weight
    updates the engine had received when it generated the completion. `ref_logprobs` are the frozen
    reference's log-probs of `token_ids`, when a device computed them in the rollout phase
    (`interleave`); otherwise the trainer computes them.
    """

    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int = 0
    sample_index: int = 0
    ref_logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    rollout_stats: dict[str, float] | None = None  # what the rollout function counted (turns, tool calls, ...)
    turn_rewards: list[tuple[int, float]] | None = None  # (index into token_ids, reward): an environment's per turn

    @property
    def environment_reward(self) -> float:
        """The sum of the rewards an environment gave the sample's turns (0 without any)."""
        return float(sum(r for _, r in self.turn_rewards)) if self.turn_rewards else 0.0

    @property
    def policy_token_count(self) -> int:
        """Tokens the policy sampled (those with loss mask 1)."""
        return len(self.token_ids) if self.loss_mask is None else int(sum(self.loss_mask))

    def check(self) -> None:
        """ValueError unless token ids, log-probs and loss mask have one entry per token, the mask holds only
        0 and 1, and every inserted token's log-prob is 0 (what the contract of a rollout function asks)."""
        lengths = {"token_ids": len(self.token_ids), "logprobs": len(self.logprobs)}
        if self.loss_mask is not None:
            lengths["loss_mask"] = len(self.loss_mask)
        if len(set(lengths.values())) != 1:
            raise ValueError(f"completion {self.prompt_index}/{self.sample_index}: lengths differ ({lengths})")
        if self.loss_mask is not None:
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError(f"completion {self.prompt_index}/{self.sample_index}: loss_mask holds values other "
                                 "than 0 and 1")
            if any(m == 0 and lp != 0.0 for m, lp in zip(self.loss_mask, self.logprobs, strict=True)):
                raise ValueError(f"completion {self.prompt_index}/{self.sample_index}: an inserted token (loss_mask 0) "
                                 "has a non-zero log-prob; inserted tokens carry log-prob 0")
        for position, reward in self.turn_rewards or ():
            if not 0 <= position < len(self.token_ids) or not math.isfinite(reward):
                raise ValueError(f"completion {self.prompt_index}/{self.sample_index}: turn reward {reward} at token "
                                 f"{position} is not a finite number at one of its {len(self.token_ids)} tokens")


@dataclass
class TokenBatch:
    """Prompt + completion token rows laid out for the trainer.

    Shapes: all `[B, T]`. Prompts are left-padded and completions right-padded, so every
    completion starts at the same column. `response_mask` is 1 on the completion tokens the policy sampled
    (including a final EOS) and 0 on tokens a rollout function inserted (`Completion.loss_mask`), on
    prompts and on padding: every loss, KL, entropy, advantage, value and log-prob statistic counts
    only where it is 1. Log-prob tensors are aligned with `input_ids`: entry `[b, t]` is the log-prob of
    `input_ids[b, t]` given the tokens before it (0 where no prediction is made).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor | None = None  # [B], or [B, T] for token-level estimators
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    staleness: torch.Tensor | None = None  # [B] trainer updates since the policy that sampled each row
    rewards: torch.Tensor | None = None  # [B] outcome rewards, for estimators computed on the trainer (GAE)
    old_values: torch.Tensor | None = None  # [B, T] the critic's values at preparation time (V of the state before t)
    returns: torch.Tensor | None = None  # [B, T] the critic's regression targets
    turn_rewards: torch.Tensor | None = None  # [B, T] an environment's per-turn rewards at their turns' last tokens (GAE)
    images: tuple[ImageInputs | None, ...] | None = None  # per row: its prompt's images (vision-language policies)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: torch.Tensor | slice) -> TokenBatch:
        """Return the sub-batch of the given rows (all tensor fields indexed alike)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]
        return TokenBatch(
            input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows], rollout_logprobs=self.rollout_logprobs[rows],
            advantages=pick(self.advantages), old_logprobs=pick(self.old_logprobs), ref_logprobs=pick(self.ref_logprobs),
            staleness=pick(self.staleness), rewards=pick(self.rewards), old_values=pick(self.old_values),
            returns=pick(self.returns), turn_rewards=pick(self.turn_rewards), images=self._pick_images(rows),
        )

    def _pick_images(self, rows: torch.Tensor | slice) -> tuple[ImageInputs | None, ...] | None:
        if self.images is None:
            return None
        index = range(self.size)[rows] if isinstance(rows, slice) else torch.as_tensor(rows).reshape(-1).tolist()
        return tuple(self.images[i] for i in index)


    def crop(self) -> tuple[TokenBatch, slice]:
        """The batch without its leading and trailing columns that hold no token of any row, and the
        columns kept: a pass over a few rows of a batch laid out for many does not compute the others'
        padding. Every `[B, T]` field is cropped alike; positions (from the attention mask) do not change."""
        filled = self.attention_mask.any(dim=0).nonzero()
        if not filled.numel():
            return self, slice(0, self.input_ids.shape[1])
        cols = slice(int(filled[0]), int(filled[-1]) + 1)

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[:, cols] if isinstance(t, torch.Tensor) and t.dim() == 2 else t
        return TokenBatch(**{f.name: cut(getattr(self, f.name)) for f in fields(self)}), cols


def build_token_batch(completions: list[Completion], pad_id: int) -> TokenBatch:
    """Lay out completions as a `TokenBatch` (left-padded prompts, right-padded completions); with
    `ref_logprobs` when every completion carries the reference's log-probs, `turn_rewards` when a completion
    has an environment's rewards, and `images` when a completion's `prompt_ids` is a `VisionPrompt`."""
    prompt_len = max(len(c.prompt_ids) for c in completions)
    resp_len = max(max(len(c.token_ids) for c in completions), 1)
    rows = len(completions)
    input_ids = torch.full((rows, prompt_len + resp_len), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, prompt_len + resp_len), dtype=torch.long)
    response_mask = torch.zeros((rows, prompt_len + resp_len), dtype=torch.float32)
    rollout_lp = torch.zeros((rows, prompt_len + resp_len), dtype=torch.float32)
    with_reference = all(c.ref_logprobs is not None for c in completions)
    ref_lp = torch.zeros_like(rollout_lp) if with_reference else None
    turn_rewards = torch.zeros_like(rollout_lp) if any(c.turn_rewards for c in completions) else None
    for row, c in enumerate(completions):
        start = prompt_len - len(c.prompt_ids)
        end = prompt_len + len(c.token_ids)
        input_ids[row, start:prompt_len] = torch.tensor(list(c.prompt_ids), dtype=torch.long)
        input_ids[row, prompt_len:end] = torch.tensor(c.token_ids, dtype=torch.long)
        attention[row, start:end] = 1
        response_mask[row, prompt_len:end] = 1.0 if c.loss_mask is None else torch.tensor(c.loss_mask, dtype=torch.float32)
        rollout_lp[row, prompt_len:end] = torch.tensor(c.logprobs, dtype=torch.float32)
        if ref_lp is not None:
            ref_lp[row, prompt_len:end] = torch.tensor(c.ref_logprobs, dtype=torch.float32)
        if turn_rewards is not None:
            for position, reward in c.turn_rewards or ():
                turn_rewards[row, prompt_len + position] += reward
    images = tuple(prompt_images(c.prompt_ids) for c in completions)
    return TokenBatch(input_ids=input_ids, attention_mask=attention, response_mask=response_mask, rollout_logprobs=rollout_lp,
                      ref_logprobs=ref_lp, turn_rewards=turn_rewards,
                      images=images if any(i is not None for i in images) else None)


ModelScores = dict[str, list[Verdict]]
"""What the reward models of one device said about a list of samples: by reward kind (``judge``,
``reward_model``, a registered kind; `gcore_rl.rewards.kinds`), one verdict per sample, aligned with the list."""


@dataclass(frozen=True)
class RolloutWork:
    """What a device did in the rollout phase of a step so far, counted rather than timed (a device
    worker's answer to its controller; `total` adds up a slice's). These counts do not depend on how
    loaded the machine is, so a test can compare the policy's work with the judge's.

    Attributes:
        policy_tokens: tokens the policy engine generated.
        policy_prefill_tokens: prompt token positions the policy engine prefilled.
        judge_tokens: tokens the judge generated (its verdicts, reasoning included).
        judge_prefill_tokens: judge-prompt token positions the judge prefilled.
        judged_samples: samples the judge scored.
    """

    policy_tokens: float = 0.0
    policy_prefill_tokens: float = 0.0
    judge_tokens: float = 0.0
    judge_prefill_tokens: float = 0.0
    judged_samples: float = 0.0

    @classmethod
    def total(cls, parts: list[RolloutWork]) -> RolloutWork:
        """The field-by-field sum of `parts` (a slice's devices)."""
        return cls(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields(cls)})


@dataclass(frozen=True)
class EngineRounds:
    """What one generation engine did in a step, as sums that add up over devices and steps: the decode
    rounds without a prefill (`rounds`; Σ B, Σ s, Σ B², Σ B·s over their batch sizes B and seconds s)
    and all of its work (`decode_steps`, generated `tokens`, `prefills`, `prefill_tokens`) with the
    seconds it kept its device busy (`busy_s`). `gcore_rl.costmodel.replay.fit_engine` fits the engine's
    costs to them (a least-squares line through the rounds, prefill from what the busy time leaves).
    """

    rounds: float = 0.0
    batch: float = 0.0
    seconds: float = 0.0
    batch_sq: float = 0.0
    batch_seconds: float = 0.0
    decode_steps: float = 0.0
    tokens: float = 0.0
    prefills: float = 0.0
    prefill_tokens: float = 0.0
    busy_s: float = 0.0

    @classmethod
    def of_call(cls, batches: Sequence[int], seconds: Sequence[float], decode_steps: int, tokens: int, prefills: int,
                prefill_tokens: int) -> EngineRounds:
        """One generate call: its decode rounds' batch sizes and seconds, and its counts (busy time 0: the
        caller adds the role's measured busy time)."""
        return cls(rounds=float(len(batches)), batch=float(sum(batches)), seconds=float(sum(seconds)),
                   batch_sq=float(sum(b * b for b in batches)),
                   batch_seconds=float(sum(b * t for b, t in zip(batches, seconds, strict=True))),
                   decode_steps=float(decode_steps), tokens=float(tokens), prefills=float(prefills),
                   prefill_tokens=float(prefill_tokens))

    def __add__(self, other: EngineRounds) -> EngineRounds:
        return EngineRounds(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class WaveWork:
    """The counted work of one wave on one controller's slice, in tokens: what dynamic placement
    replays at every split (`gcore_rl.costmodel.replay`). None of it depends on the split it ran under.

    Attributes:
        prompt_tokens: [P] tokens of each prompt.
        response_tokens: [P * G] tokens of each completion, prompt-major (G = samples per prompt).
        verdict_tokens: [P * G] tokens the judge generated per completion (empty: no judge).
        judge_prompt_tokens: [P * G] tokens of each judge prompt (empty: no judge).
    """

    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]
    verdict_tokens: tuple[int, ...] = ()
    judge_prompt_tokens: tuple[int, ...] = ()
