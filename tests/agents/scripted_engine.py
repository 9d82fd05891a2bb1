"""An engine that answers from a script, for the multi-turn rollout functions' tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from gcore_rl.records import Completion
from gcore_rl.rollout.protocol import Continuation


class ScriptedEngine:
    """An engine that answers each call from a script: turn k of every sequence is `turns[k]` (text), with
    log-prob -0.5 a token; it records the continuation requests it was given."""

    def __init__(self, tokenizer, turns: Sequence[str]):
        self.tokenizer, self.turns = tokenizer, [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.calls = 0
        self.requests: list[Continuation] = []

    def _answer(self, count: int, per_prompt: int, limits: Sequence[int]) -> list[Completion]:
        ids = self.turns[self.calls]
        self.calls += 1
        out = []
        for index in range(count):
            taken = ids[:limits[index]]
            out += [Completion(index, [], taken, [-0.5] * len(taken),
                               "stop" if taken and taken[-1] == self.tokenizer.eos_token_id else "length",
                               sample_index=s) for s in range(per_prompt)]
        return out

    def generate_stream(self, prompts, params, seed=None, max_new_tokens=None) -> Iterator[list[Completion]]:
        yield self._answer(len(prompts), params.n, max_new_tokens or [params.max_new_tokens] * len(prompts))

    def continue_stream(self, requests, params, seed=None) -> Iterator[list[Completion]]:
        self.requests += list(requests)
        yield self._answer(len(requests), 1, [r.max_new_tokens for r in requests])
