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


class SampleLog:
    """Appends `{"step", "prompt", "completion", "reward"}` lines to `samples.jsonl`, `limit` per step."""

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
            self._file.write(json.dumps({"step": step, "prompt": prompt, "completion": text, "reward": reward}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
