"""The multi-turn loop that tool-using (`tool_turns`) and environment (`env_turns`) rollout functions share.

A trajectory is the prompt, then assistant turns exactly as the engine sampled them (loss mask 1, the engine's
log-probs), with the ids of what answers each turn inserted between them (a tool's result, an environment's
next message: loss mask 0, log-prob 0). `turn_loop` generates every trajectory's first turn in one engine call,
hands the turns to an `Answerer`, which inserts what answers them into the trajectories that go on, and
continues those through `RolloutEngine.continue_stream` -- one batched call per turn -- until none goes on or
`max_turns` turns are done. Finished trajectories are yielded as they end.

`sampling.max_new_tokens` counts every token after the prompt, inserted ones included (`Trajectory.fits`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from gcore_rl.records import Completion
from gcore_rl.rollout.functions import RolloutRequest
from gcore_rl.rollout.protocol import Continuation


@dataclass
class Trajectory:
    """One sample's ids after the prompt so far, with log-probs, loss mask, rewards and counts.

    `rewards` are `(position, reward)` pairs: a reward an environment gave for the assistant turn whose last
    token is `ids[position]`. `stats` are the function's per-sample counts (`Completion.rollout_stats`)."""

    prompt_index: int
    sample_index: int
    prompt_ids: Sequence[int]  # as the request gave it (a `VisionPrompt` keeps its images)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    finish_reason: str = "stop"
    policy_version: int = 0
    last_turn: list[int] = field(default_factory=list)  # the ids of the latest assistant turn
    rewards: list[tuple[int, float]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    def add_turn(self, turn: Completion) -> None:
        self.ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.mask += [1] * len(turn.token_ids)
        self.last_turn = list(turn.token_ids)
        self.turns += 1
        self.finish_reason = turn.finish_reason
        # the oldest weights of its turns (a backend may load new weights between calls)
        self.policy_version = turn.policy_version if self.turns == 1 else min(self.policy_version, turn.policy_version)

    def insert(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    def reward_turn(self, reward: float) -> None:
        """Credit `reward` to the latest assistant turn (at its last token; an empty turn has none to carry it, so
        it goes to the last token before it, or is dropped when the trajectory has no token yet)."""
        if self.ids:
            self.rewards.append((len(self.ids) - 1, float(reward)))

    def count(self, name: str, value: float = 1.0) -> None:
        self.stats[name] = self.stats.get(name, 0.0) + value

    def fits(self, inserted: Sequence[int], budget: int) -> bool:
        """Whether `inserted` and at least one token of reply fit in `budget` tokens after the prompt; when not, the
        trajectory is marked cut by length."""
        if len(self.ids) + len(inserted) < budget:
            return True
        self.finish_reason = "length"
        return False

    def completion(self) -> Completion:
        return Completion(prompt_index=self.prompt_index, sample_index=self.sample_index, prompt_ids=self.prompt_ids,
                          token_ids=self.ids, logprobs=self.logprobs, loss_mask=self.mask,
                          finish_reason=self.finish_reason, policy_version=self.policy_version,  # type: ignore[arg-type]
                          rollout_stats={"turns": float(self.turns), **self.stats},
                          turn_rewards=list(self.rewards) if self.rewards else None)


Answerer = Callable[[list[Trajectory], bool], list[Trajectory]]
"""`(trajectories, last)` → those that go on: given the trajectories whose latest turn just finished (`last`: no
further turn is allowed), insert into each one that goes on the ids that answer its turn."""


def turn_loop(request: RolloutRequest, max_turns: int, answer: Answerer,
              start: Callable[[Trajectory], None] | None = None) -> Iterator[list[Completion]]:
    """Run `request`'s trajectories turn by turn (see the module docstring); `start` is called on each trajectory
    when it is created (before `answer` first sees it)."""
    budget = request.params.max_new_tokens
    trajectories: dict[tuple[int, int], Trajectory] = {}
    turns = [c for chunk in request.engine.generate_stream(request.prompts, request.params, seed=request.seed)
             for c in chunk]
    for turn_number in range(1, max_turns + 1):
        finished: list[Trajectory] = []
        for turn in turns:
            key = (turn.prompt_index, turn.sample_index)
            if key not in trajectories:
                trajectories[key] = Trajectory(*key, request.prompts[turn.prompt_index])
                if start is not None:
                    start(trajectories[key])
            trajectories[key].add_turn(turn)
            finished.append(trajectories[key])
        going = answer(finished, turn_number == max_turns)
        kept = {id(t) for t in going}
        ending = [t for t in finished if id(t) not in kept]
        if ending:
            yield [t.completion() for t in ending]
        if not going:
            return
        requests = [Continuation(prefix=t.prompt_ids, appended=list(t.ids), max_new_tokens=budget - len(t.ids))
                    for t in going]
        answered = [c for chunk in request.engine.continue_stream(requests, request.params,
                                                                  seed=turn_seed(request.seed, turn_number)) for c in chunk]
        turns = [_as_turn(c, going[c.prompt_index]) for c in answered]


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` + 1 of a request seeded `seed`: far from the seeds of the request's other
    waves and devices (`seed + 1`, ...), so its draws are not those of another wave's first turn."""
    return (seed * 1_000_003 + turn * 7_919) % 2**62


def _as_turn(continuation: Completion, trajectory: Trajectory) -> Completion:
    """A continuation (indexed by request) as the next turn of `trajectory`."""
    continuation.prompt_index, continuation.sample_index = trajectory.prompt_index, trajectory.sample_index
    return continuation
