"""A rollout function for the tests of the rollout seam: two policy turns with fixed "tool" tokens between.

Turn one generates at most `first_turn_tokens`; the tool's tokens (`tool_text`, encoded once with the
policy's tokenizer) are appended after it, whatever it said; turn two continues the whole sequence through
`RolloutEngine.continue_stream` with `second_turn_tokens`. The completion is turn one + tool + turn two,
with loss mask 1, 0, 1 and log-prob 0 on the tool's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

from gcore_rl.records import Completion
from gcore_rl.rollout.functions import RolloutRequest
from gcore_rl.rollout.protocol import Continuation


def tool_between_turns(request: RolloutRequest) -> Iterator[list[Completion]]:
    options = request.options
    first_limit = int(options.get("first_turn_tokens", 3))
    second_limit = int(options.get("second_turn_tokens", 3))
    tool = request.tokenizer.encode(options.get("tool_text", "[7]"), add_special_tokens=False)
    engine, params = request.engine, request.params
    first = [c for chunk in engine.generate_stream(request.prompts, params, request.seed,
                                                   [first_limit] * len(request.prompts)) for c in chunk]
    follow_ups = [Continuation(prefix=[*request.prompts[c.prompt_index], *c.token_ids], appended=tool,
                               max_new_tokens=second_limit) for c in first]
    for chunk in engine.continue_stream(follow_ups, params, seed=request.seed + 1):
        yield [_joined(first[second.prompt_index], tool, second) for second in chunk]


def _joined(first: Completion, tool: list[int], second: Completion) -> Completion:
    return Completion(prompt_index=first.prompt_index, sample_index=first.sample_index, prompt_ids=first.prompt_ids,
                      token_ids=[*first.token_ids, *tool, *second.token_ids],
                      logprobs=[*first.logprobs, *[0.0] * len(tool), *second.logprobs],
                      loss_mask=[1] * len(first.token_ids) + [0] * len(tool) + [1] * len(second.token_ids),
                      finish_reason=second.finish_reason, policy_version=second.policy_version)
