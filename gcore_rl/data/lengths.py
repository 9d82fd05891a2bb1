"""Prompts against the policy's context: every prompt plus its completion must fit the model.

A prompt of ``p`` tokens sampled for up to ``sampling.max_new_tokens`` new tokens needs
``p + max_new_tokens`` positions; a model with ``max_position_embeddings`` positions silently
produces garbage past them (or fails inside an attention kernel). So each controller measures its
shard once, before the first step, and `data.overlong_prompts` decides what happens to a prompt
that does not fit: ``error`` (the default) stops the job naming the row, ``truncate`` keeps the
prompt's last tokens, ``drop`` leaves the row out. Truncated and dropped rows are counted
(`FittedPrompts.metrics`).

A prompt is measured as rollout encodes it (`gcore_rl.data.prompts.PromptEncoder`): a row with
images counts its image tokens, which the policy's image processor decides. Such a prompt is never
truncated (its last tokens could cut through an image), so under ``truncate`` a row with images that
does not fit is an error. Encoding every row of the shard before the first step also finds the rows
the policy cannot read: images for a text-only policy, placeholders that do not pair up with images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from gcore_rl.data.chat import ChatRenderer, is_chat_row, render_prompt_rows, resolve_chat_template
from gcore_rl.data.config import OverlongPolicy, RolloutDataConfig
from gcore_rl.data.prompts import PromptEncoder
from gcore_rl.data.sources import load_eval_rows, load_prompt_rows
from gcore_rl.errors import ConfigError, DataError
from gcore_rl.models.vision import IMAGE_PLACEHOLDER

_ENCODE_BATCH = 1024
"""Prompts tokenized per call while measuring a shard."""


@dataclass
class FittedPrompts:
    """The rows that fit the context, and how many had to be shortened or left out to get there."""

    rows: list[dict[str, Any]]
    truncated: int = 0
    dropped: int = 0
    ids: list[int] = field(default_factory=list)
    """The global row number of each of `rows` (`row_ids` of `fit_prompts` for the rows kept)."""

    def metrics(self) -> dict[str, float]:
        """Step metrics ``data/prompts_truncated`` and ``data/prompts_dropped`` (summed over controllers)."""
        return {"data/prompts_truncated": float(self.truncated), "data/prompts_dropped": float(self.dropped)}


@dataclass(frozen=True)
class PromptRoom:
    """Room for a prompt: the policy's context (or the trainer's token budget per pass, when smaller)
    less the positions kept for the completion."""

    positions: int | None  # the model's max_position_embeddings (None: the config names no limit)
    max_new_tokens: int
    model_path: str
    token_budget: int = 0  # train.max_tokens_per_micro_batch (0 = none): one trainer pass must hold a whole row
    engine_limit: int = 0  # engine.vllm.max_model_len (0 = none): the vLLM server's longest sequence

    def _limit(self) -> tuple[int | None, str]:
        """The binding limit on prompt + completion tokens (the smallest; the model's on a tie), and what sets it."""
        model = (self.positions, f"the model '{self.model_path}' has max_position_embeddings={self.positions}")
        limits = [limit for limit in (
            model,
            (self.token_budget, f"train.max_tokens_per_micro_batch={self.token_budget} (a trainer pass holds whole rows)"),
            (self.engine_limit, f"engine.vllm.max_model_len={self.engine_limit} (the vLLM server's longest sequence)"),
        ) if limit[0]]
        return min(limits, key=lambda limit: limit[0]) if limits else model

    def budget(self) -> int | None:
        """Most prompt tokens that fit (None: no known limit); ConfigError when the completion alone fills the limit."""
        limit, source = self._limit()
        if limit is None:
            return None
        if self.max_new_tokens >= limit:
            raise ConfigError("sampling.max_new_tokens", f"{self.max_new_tokens} new tokens leave no room for a "
                              f"prompt: {source}; lower it or raise that limit")
        return limit - self.max_new_tokens

    def describe(self) -> str:
        return f"{self._limit()[1]}, and sampling.max_new_tokens={self.max_new_tokens} of them are kept for the completion"


@dataclass
class FittedShard:
    """A controller's rows, fitted to the policy's context: training rows with their global row
    numbers, held-out rows, and the fitting's step metrics (empty under ``error``, where every row
    fits or the job has stopped)."""

    rows: list[dict[str, Any]]
    row_ids: list[int]
    eval_rows: list[dict[str, Any]]
    metrics: dict[str, float]


def load_fitted_shard(data: RolloutDataConfig, prompts: PromptEncoder, room: PromptRoom,
                      shard_index: int, num_shards: int, tools: Sequence[dict[str, Any]] = ()) -> FittedShard:
    """A controller's training and held-out rows, fitted to `room` by `data.overlong_prompts`.

    Chat-format rows get their rendered prompt first (`gcore_rl.data.chat.render_prompt_rows`), with the
    schemas of `tools` handed to the chat template.
    `prompts` encodes rows as rollout will (the policy's tokenizer, and its image processor for a
    vision-language policy).
    """
    tokenizer = prompts.tokenizer
    rows = load_prompt_rows(data, shard_index, num_shards)
    row_ids = range(shard_index, shard_index + len(rows) * num_shards, num_shards)
    eval_rows = load_eval_rows(data, shard_index, num_shards)
    eval_ids = range(shard_index, shard_index + len(eval_rows) * num_shards, num_shards)
    held_out_source = f"the held-out rows of {data.source_name()}"
    if any(is_chat_row(row) for row in [*rows, *eval_rows]):
        renderer = ChatRenderer(tokenizer, resolve_chat_template(tokenizer, data.chat_template, room.model_path), tools)
        rows = render_prompt_rows(rows, renderer, data.source_name(), row_ids)
        eval_rows = render_prompt_rows(eval_rows, renderer, held_out_source, eval_ids)
    train = fit_prompts(rows, prompts, room, data.overlong_prompts, data.source_name(), row_ids)
    held_out = fit_prompts(eval_rows, prompts, room, data.overlong_prompts, held_out_source, eval_ids)
    metrics = {}
    if data.overlong_prompts != "error":
        metrics = FittedPrompts([], train.truncated + held_out.truncated, train.dropped + held_out.dropped).metrics()
    return FittedShard(rows=train.rows, row_ids=train.ids, eval_rows=held_out.rows, metrics=metrics)


def fit_prompts(rows: Sequence[dict[str, Any]], prompts: PromptEncoder, room: PromptRoom,
                policy: OverlongPolicy, source: str, row_ids: Sequence[int]) -> FittedPrompts:
    """Apply `policy` to every row whose prompt has more than `room.budget()` tokens (none without a known limit).

    Prompts are measured as rollout encodes them (`prompts`: no special tokens, image tokens
    included). Messages name a row as ``{source}, row {row_ids[i]}`` (the global row of a shard's
    `rows[i]`). ``error`` raises DataError at the first long row; ``truncate`` replaces its prompt
    with the text of its last `room.budget()` tokens, but raises DataError for a row with images;
    ``drop`` removes it, and raises DataError when no row is left. A row the policy cannot encode
    (images for a text-only policy, placeholders and images that do not pair up) raises DataError
    whatever the limit.
    """
    budget = room.budget()
    fitted = FittedPrompts([])
    for start in range(0, len(rows), _ENCODE_BATCH):
        chunk = rows[start : start + _ENCODE_BATCH]
        wheres = [f"{source}, row {row_ids[start + offset]}" for offset in range(len(chunk))]
        measured = _prompt_lengths(chunk, prompts, wheres, measure=budget is not None)
        for offset, (row, length) in enumerate(zip(chunk, measured, strict=True)):
            row_id, images = row_ids[start + offset], len(row.get("images") or [])
            if budget is None or length <= budget:
                fitted.rows.append(row)
                fitted.ids.append(row_id)
            elif policy == "error" or (policy == "truncate" and images):
                raise DataError(_too_long(wheres[offset], length, images, budget, room, policy))
            elif policy == "truncate":
                shortened = _last_tokens_text(prompts.tokenizer, prompts.text(row["prompt"]), budget)
                fitted.rows.append({**row, "prompt": shortened})
                fitted.ids.append(row_id)
                fitted.truncated += 1
            else:
                fitted.dropped += 1
    if rows and not fitted.rows:
        raise DataError(f"all {len(rows)} prompts of {source} held by this controller are too long ({room.describe()}), "
                        "so data.overlong_prompts=drop left none; use shorter prompts or lower sampling.max_new_tokens")
    return fitted


def _prompt_lengths(rows: Sequence[dict[str, Any]], prompts: PromptEncoder, wheres: Sequence[str],
                    measure: bool) -> list[int]:
    """Tokens of each row's prompt as `prompts` encodes it (0 for a text row when not `measure`d).

    Rows with images, and rows with image placeholders for a vision-language policy, are measured by
    the encoder one by one (`PromptEncoder.length`: image tokens from the images' sizes, no pixel
    preprocessing; DataError naming the row when the policy cannot read it); the others are tokenized
    in one batch.
    """
    vision = prompts.processor is not None
    lengths, text = [], []
    for index, (row, where) in enumerate(zip(rows, wheres, strict=True)):
        encoded_alone = bool(row.get("images")) or (vision and IMAGE_PLACEHOLDER in row["prompt"])
        lengths.append(prompts.length(row, where) if encoded_alone else 0)
        if not encoded_alone:
            text.append(index)
    if measure and text:
        encoded = prompts.tokenizer([rows[i]["prompt"] for i in text], add_special_tokens=False)["input_ids"]
        for index, ids in zip(text, encoded, strict=True):
            lengths[index] = len(ids)
    return lengths


def _too_long(where: str, length: int, images: int, budget: int, room: PromptRoom, policy: OverlongPolicy) -> str:
    """The message for a prompt of `length` tokens over `budget` that `policy` cannot fix."""
    tokens = f"{length} tokens (its {images} image(s) included)" if images else f"{length} tokens"
    message = f"{where}: the prompt has {tokens} but only {budget} fit ({room.describe()}); "
    if policy == "truncate":
        return message + ("data.overlong_prompts=truncate never shortens a prompt with images (its last tokens could "
                          "cut through an image); use smaller or fewer images, lower sampling.max_new_tokens, or set "
                          "data.overlong_prompts=drop (leave such rows out)")
    return message + ("shorten it, lower sampling.max_new_tokens, or set data.overlong_prompts=truncate (keep its "
                      "last tokens; not for prompts with images) or drop (leave it out)")


def _last_tokens_text(tokenizer: PreTrainedTokenizerBase, ids: list[int], budget: int) -> str:
    """Text of the last `budget` tokens of `ids`, shortened further if it re-encodes to more tokens."""
    keep = budget
    while True:
        text = tokenizer.decode(ids[-keep:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        excess = len(tokenizer.encode(text, add_special_tokens=False)) - budget
        if excess <= 0 or keep <= 1:
            return text
        keep = max(keep - excess, 1)
