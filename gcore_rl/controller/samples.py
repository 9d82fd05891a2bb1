"""A few completions of each step, as text with their rewards, for the run report (`samples.jsonl`)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from gcore_rl.algos.dynamic_sampling import StepBatch
from gcore_rl.controller.program import GroupPayload, decode_completions
from gcore_rl.records import Completion


def pick_samples(batch: StepBatch, limit: int) -> list[tuple[Completion, float]]:
    """Up to `limit` (completion, reward) pairs of the step's real groups (padding skipped), taken
    round-robin over the groups (each group's first sample, then each group's second, ...) so that
    a few lines show several prompts."""
    groups = [(g.payload.completions, g.rewards) for g, valid in zip(batch.groups, batch.mask, strict=True)
              if valid and isinstance(g.payload, GroupPayload)]
    picked: list[tuple[Completion, float]] = []
    for index in range(max((len(c) for c, _ in groups), default=0)):
        for completions, rewards in groups:
            if len(picked) == limit:
                return picked
            if index < len(completions):
                picked.append((completions[index], float(rewards[index])))
    return picked


def turn_segments(tokenizer: PreTrainedTokenizerBase, completion: Completion) -> list[dict[str, object]]:
    """A multi-turn completion as runs of the policy's and of inserted tokens (`loss_mask` 1 and 0), each decoded
    with its special tokens: `[{"text": ..., "inserted": bool}]`, in order."""
    mask = completion.loss_mask or [1] * len(completion.token_ids)
    runs: list[tuple[int, list[int]]] = []
    for token, keep in zip(completion.token_ids, mask, strict=True):
        if runs and runs[-1][0] == keep:
            runs[-1][1].append(token)
        else:
            runs.append((keep, [token]))
    return [{"text": tokenizer.decode(ids, skip_special_tokens=False), "inserted": not keep} for keep, ids in runs]


class SampleLog:
    """Appends `{"step", "prompt", "completion", "reward"}` lines to `samples.jsonl`, `limit` per step; a completion
    with inserted tokens (a tool's answers) also gets its `turns` (`turn_segments`)."""

    def __init__(self, path: Path, tokenizer: PreTrainedTokenizerBase, limit: int):
        self.tokenizer = tokenizer
        self.limit = limit
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8") if limit > 0 else None

    def write(self, step: int, batch: StepBatch) -> None:
        if self._file is None:
            return
        picked = pick_samples(batch, self.limit)
        texts = decode_completions(self.tokenizer, [c for c, _ in picked])
        for (completion, reward), text in zip(picked, texts, strict=True):
            prompt = self.tokenizer.decode(completion.prompt_ids, skip_special_tokens=True)
            line = {"step": step, "prompt": prompt, "completion": text, "reward": reward}
            if completion.loss_mask is not None and 0 in completion.loss_mask:
                line["turns"] = turn_segments(self.tokenizer, completion)
            self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
