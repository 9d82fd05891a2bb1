"""Greedy accuracy of a model in training on held-out prompts: the measured criterion a warm start stops on.

A supervised warm start is useful to RL only in a band of competence: too weak and a sampled group
rarely holds a correct answer, too strong and there is nothing left to learn. How many steps reach
that band depends on the seed, the CPU and the thread count (training passes through sharp phase
changes), so the warm start is measured as it goes rather than run for a fixed number of steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from gcore_rl.data.prompts import PromptEncoder
from gcore_rl.records import RewardInput
from gcore_rl.rewards.rule import RuleRewards
from gcore_rl.rollout.protocol import RolloutEngine
from gcore_rl.rollout.sampling import SamplingConfig


class HeldOutAccuracy:
    """Scores greedy completions of `rows` with a scorer's accuracy function, on a private generation engine.

    The engine holds its own copy of the model and receives the trained weights before every
    evaluation, so evaluating never touches the trained model's modes or gradients.

    Args:
        engine: an engine of any backend serving the model's architecture (`build_engine`), used only here.
        prompts: its `PromptEncoder` (prompts encoded as in rollout, images included).
        rows: held-out rows, each with ``prompt`` and the columns `accuracy_fn` reads.
        scorer: rule rewards with an `accuracy_fn` (a failing or non-finite accuracy is a RewardError
            naming the function, as in rollout).
        max_new_tokens: longest greedy completion.
    """

    def __init__(self, engine: RolloutEngine, prompts: PromptEncoder, rows: Sequence[dict[str, Any]],
                 scorer: RuleRewards, max_new_tokens: int):
        if not rows:
            raise ValueError("HeldOutAccuracy needs at least one held-out row")
        if scorer.cfg.accuracy_fn is None:
            raise ValueError("HeldOutAccuracy needs rule rewards with an accuracy_fn")
        self.rows = list(rows)
        self.tokenizer = prompts.tokenizer
        self.scorer = scorer
        self.prompt_ids = prompts.encode_rows(self.rows)
        self.params = SamplingConfig(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
        self.engine = engine

    @torch.no_grad()
    def __call__(self, model: PreTrainedModel) -> float:
        """Mean accuracy of `model`'s greedy completions over the held-out rows."""
        self.engine.load_weights(model.named_parameters())
        completions = self.engine.generate(self.prompt_ids, self.params, seed=0)
        self.engine.take_stats()  # nobody reads them here; taken so the engine does not keep them
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        scored = self.scorer([RewardInput(prompt=row["prompt"], completion=text, row=row)
                              for row, text in zip(self.rows, texts, strict=True)])
        return sum(scored.accuracy) / len(scored.accuracy)
