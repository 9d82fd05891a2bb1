"""Greedy accuracy of a model in training on held-out prompts: the measured criterion a warm start stops on.

A supervised warm start is useful to RL only in a band of competence: too weak and a sampled group
rarely holds a correct answer, too strong and there is nothing left to learn. How many steps reach
that band depends on the seed, the CPU and the thread count (training passes through sharp phase
changes), so the warm start is measured as it goes rather than run for a fixed number of steps.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gcore_rl.errors import RewardError
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.rollout.sampling import SamplingConfig


class HeldOutAccuracy:
    """Scores greedy completions of `rows` with `accuracy_fn`, on a private generation engine.

    The engine holds its own copy of the model (made once, here) and receives the trained weights
    before every evaluation, so evaluating never touches the trained model's modes or gradients.

    Args:
        model: the model being trained (copied once for the engine).
        tokenizer: its tokenizer (prompts encoded without special tokens, as in rollout).
        rows: held-out rows, each with ``prompt`` and the columns `accuracy_fn` reads.
        accuracy_fn: ``fn(prompt, completion, **row) -> float`` in [0, 1] (a rule reward).
        accuracy_name: its import path, named when it fails.
        max_new_tokens: longest greedy completion.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict[str, Any]],
                 accuracy_fn: Callable[..., float], accuracy_name: str, max_new_tokens: int):
        if not rows:
            raise ValueError("HeldOutAccuracy needs at least one held-out row")
        self.rows = list(rows)
        self.tokenizer = tokenizer
        self.accuracy_fn = accuracy_fn
        self.accuracy_name = accuracy_name
        self.prompt_ids = [tokenizer.encode(row["prompt"], add_special_tokens=False) for row in self.rows]
        self.params = SamplingConfig(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
        self.engine = GenerationEngine(copy.deepcopy(model), tokenizer.eos_token_id, tokenizer.pad_token_id,
                                       max_num_seqs=len(self.rows))

    @torch.no_grad()
    def __call__(self, model: PreTrainedModel) -> float:
        """Mean accuracy of `model`'s greedy completions over the held-out rows."""
        self.engine.load_weights(model.named_parameters())
        completions = self.engine.generate(self.prompt_ids, self.params, seed=0)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        scores = []
        for index, (row, text) in enumerate(zip(self.rows, texts, strict=True)):
            columns = {key: value for key, value in row.items() if key != "prompt"}
            try:
                score = float(self.accuracy_fn(row["prompt"], text, **columns))
            except Exception as exc:
                raise RewardError(f"accuracy function `{self.accuracy_name}` failed on held-out row {index} "
                                  f"(prompt {row['prompt']!r}, completion {text!r}): {type(exc).__name__}: {exc}") from exc
            if not math.isfinite(score):
                raise RewardError(f"accuracy function `{self.accuracy_name}` returned {score} on held-out row {index} "
                                  f"(prompt {row['prompt']!r}); it must return a finite number")
            scores.append(score)
        return sum(scores) / len(scores)
