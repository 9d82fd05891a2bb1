"""Agentic samples: several assistant turns per trajectory, each answered by a tool or an environment that takes
wall-clock time (`workload.agent`, an `AgentSettings`; text workloads only).

A trajectory of n turns (drawn uniformly in [turns_min, turns]) is: the prompt, then n assistant turns of
`turn_tokens` each, with an answer of `observation_tokens` inserted after every turn but the last, and each
answer arriving `tool_seconds` after its turn ended (a tool's or environment's latency, long-tailed). The
trainer trains the whole sequence (the answers masked), so a trajectory's response length is its turns' and
answers' tokens together (`WaveTurns.total_tokens`); the engine decodes only the turns and prefills each
answer when the trajectory comes back (the rest of its context is in the prefix cache).

An engine serves its trajectories one of two ways (`synchronous_turns`), as the project's own rollout functions
do (docs/multi-turn.md):

- **turn-synchronous** (`turn_loop`: `tool_turns`, `env_turns`): every trajectory of the engine decodes its
  turn t in one batched call; the engine then waits for the slowest answer of that turn before turn t + 1
  starts, and idles meanwhile;
- **asynchronous** (`agent_loop` through the chat endpoint): a trajectory leaves the batch when its turn ends
  and re-enters (its answer prefilled) when the answer arrives; meanwhile its slot serves other trajectories.
  The engine idles only when every trajectory it holds is waiting.

`run_agent_engines` prices both on many engines and returns a `DecodeRun` whose `idle_seconds` are the waits:
an engine's wall time is its busy time plus them.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from gcore_rl.costmodel import cost
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.decode import DecodeRun, run_engines
from gcore_rl.costmodel.distributions import LatencyDistribution, LengthDistribution
from gcore_rl.costmodel.hardware import Hardware
from gcore_rl.costmodel.models import ModelSpec
from gcore_rl.errors import ConfigError


@dataclass(frozen=True)
class AgentSettings:
    """The turns of each trajectory of a text workload (`workload.agent`; turns 1 = single-turn, the workload's
    numbers as without this section)."""

    turns: int = field(default=1, metadata={"help": "Most assistant turns of a trajectory; 1 = single-turn (this section is not used, and response_tokens gives the lengths)."})
    turns_min: int | None = field(default=None, metadata={"help": "Fewest assistant turns: each trajectory draws turns_min .. turns uniformly. null = exactly turns."})
    turn_tokens: LengthDistribution = field(default_factory=lambda: LengthDistribution(256.0, 0.6, 2048), metadata={"help": "Tokens the policy writes in one turn (used instead of response_tokens)."})
    observation_tokens: LengthDistribution = field(default_factory=lambda: LengthDistribution(128.0, 0.8, 2048), metadata={"help": "Tokens one answer (a tool's result, an environment's message) inserts after a turn."})
    tool_seconds: LatencyDistribution = field(default_factory=LatencyDistribution, metadata={"help": "Seconds from the end of a turn to its answer (a tool call, an environment step)."})
    synchronous_turns: bool = field(default=False, metadata={"help": "true: each engine decodes turn t of all its trajectories in one call and waits for the slowest answer before turn t + 1 (turn_loop: tool_turns, env_turns). false: a trajectory leaves the batch while it waits and re-enters when its answer arrives (agent_loop)."})

    def validate(self) -> None:
        if self.turns < 1:
            raise ConfigError("turns", f"must be at least 1, got {self.turns}")
        if self.turns_min is not None and not 1 <= self.turns_min <= self.turns:
            raise ConfigError("turns_min", f"must be in [1, turns = {self.turns}], got {self.turns_min}")

    @property
    def enabled(self) -> bool:
        """Whether a trajectory may take more than one turn."""
        return self.turns > 1


@dataclass(frozen=True)
class WaveTurns:
    """The turns of one wave's trajectories: arrays over [slice, prompt, sample, ...]; a turn or answer past the
    trajectory's last is 0."""

    turn_tokens: np.ndarray  # [K, P, G, T] tokens the policy writes in each turn
    observation_tokens: np.ndarray  # [K, P, G, T - 1] tokens of the answer after each turn
    tool_seconds: np.ndarray  # [K, P, G, T - 1] seconds from each turn's end to its answer

    @property
    def turns(self) -> np.ndarray:
        """[K, P, G] assistant turns of each trajectory."""
        return (self.turn_tokens > 0).sum(axis=-1)

    @property
    def total_tokens(self) -> np.ndarray:
        """[K, P, G] tokens after the prompt: every turn and every answer (what the trainer's row holds)."""
        return self.turn_tokens.sum(axis=-1) + self.observation_tokens.sum(axis=-1)

    @property
    def policy_tokens(self) -> np.ndarray:
        """[K, P, G] tokens the policy decodes."""
        return self.turn_tokens.sum(axis=-1)

    def take(self, slices: Sequence[int] | np.ndarray) -> WaveTurns:
        """The trajectories of the slices `slices` only."""
        return WaveTurns(*(getattr(self, f.name)[np.asarray(slices)] for f in fields(self)))

    def take_prompts(self, prompts: Sequence[int] | np.ndarray) -> WaveTurns:
        """The trajectories of the prompts `prompts` of every slice (in that order; repeats allowed)."""
        return WaveTurns(*(getattr(self, f.name)[:, np.asarray(prompts)] for f in fields(self)))

    def rows(self) -> WaveTurns:
        """The same trajectories as rows: arrays [K * P * G, ...], slice-, then prompt-, then sample-major."""
        return WaveTurns(*(getattr(self, f.name).reshape(-1, getattr(self, f.name).shape[-1]) for f in fields(self)))


def draw_turns(rng: np.random.Generator, settings: AgentSettings, shape: tuple[int, int, int],
               scale: float | np.ndarray = 1.0) -> WaveTurns:
    """The turns of `shape` = (slices, prompts, samples) trajectories: each one's turn count, its turns' and answers'
    lengths and its answers' latencies, drawn from `rng`; `scale` multiplies the turn-length median."""
    T = settings.turns
    low = settings.turns_min if settings.turns_min is not None else T
    count = rng.integers(low, T, size=shape, endpoint=True)
    turn = np.maximum(settings.turn_tokens.sample(rng, (*shape, T), np.asarray(scale)[..., None]), 1)
    answer = settings.observation_tokens.sample(rng, (*shape, T - 1))
    latency = settings.tool_seconds.sample(rng, (*shape, T - 1))
    index = np.arange(T)
    taken = index[None, None, None, :] < count[..., None]  # [K, P, G, T]: the trajectory's turns
    answered = taken[..., 1:]  # an answer follows turn t when turn t + 1 is taken
    return WaveTurns(turn_tokens=np.where(taken, turn, 0), observation_tokens=np.where(answered, answer, 0),
                     tool_seconds=np.where(answered, latency, 0.0))


def run_agent_engines(engine: np.ndarray, context: np.ndarray, turns: WaveTurns, engines: int,
                      prefill_tokens: np.ndarray, model: ModelSpec, hw: Hardware, c: CostConstants, tp: int,
                      slots: int, synchronous: bool) -> DecodeRun:
    """Simulate `engines` engines serving multi-turn trajectories (see the module docstring).

    Args:
        engine: [S] engine index of each trajectory; queue order is array order.
        context: [S] prompt tokens of each trajectory.
        turns: the trajectories' turns as rows (`WaveTurns.rows`: arrays [S, T] and [S, T - 1]).
        prefill_tokens: [E] prompt tokens each engine prefills up front (shared prompts counted once).
    Returns a `DecodeRun` whose `finish_seconds` are each trajectory's last turn's end and whose `idle_seconds`
    are each engine's waits for answers.
    """
    engine = np.asarray(engine, dtype=np.int64)
    args = (np.asarray(context, np.int64), np.asarray(turns.turn_tokens, np.int64),
            np.asarray(turns.observation_tokens, np.int64), np.asarray(turns.tool_seconds, np.float64))
    prefill_tokens = np.asarray(prefill_tokens, dtype=np.float64)
    if synchronous:
        return _synchronous(engine, *args, engines, prefill_tokens, model, hw, c, tp, slots)
    runs = [_AsyncEngine(np.flatnonzero(engine == e), *args, float(prefill_tokens[e]), model, hw, c, tp, slots).run()
            for e in range(engines)]
    finish = np.zeros(len(engine))
    for e, r in enumerate(runs):
        finish[engine == e] = r.finish
    stat = {name: np.array([getattr(r, name) for r in runs]) for name in _AsyncEngine.STATS}
    return DecodeRun(prefill_seconds=stat["prefill_seconds"], decode_seconds=stat["decode_seconds"],
                     finish_seconds=finish, steps=stat["steps"].astype(np.int64), token_steps=stat["token_steps"],
                     kv_token_steps=stat["kv_token_steps"], compute_bound_steps=stat["compute_bound_steps"],
                     prefill_tokens=stat["prefill_tokens"], idle_seconds=stat["idle_seconds"])


def _synchronous(engine: np.ndarray, context: np.ndarray, turn_tokens: np.ndarray, answers: np.ndarray,
                 latency: np.ndarray, engines: int, prefill_tokens: np.ndarray, model: ModelSpec, hw: Hardware,
                 c: CostConstants, tp: int, slots: int) -> DecodeRun:
    """Turn-synchronous engines: turn t of every trajectory still going is one continuous-batching call
    (`run_engines`; prefill: the prompts at t = 0, the answers after), and turn t + 1 starts when the engine's
    slowest answer to turn t has arrived."""
    S, T = turn_tokens.shape
    turns = (turn_tokens > 0).sum(axis=1)
    held = context.astype(np.float64).copy()  # [S] tokens before the turn (prompt, earlier turns and answers)
    clock = np.zeros(engines)  # each engine's time since its start
    total = {name: np.zeros(engines) for name in ("prefill_seconds", "decode_seconds", "steps", "token_steps",
                                                  "kv_token_steps", "compute_bound_steps", "prefill_tokens",
                                                  "idle_seconds")}
    finish = np.zeros(S)
    for t in range(T):
        going = np.flatnonzero(turns > t)
        if not len(going):
            break
        if t == 0:
            prefill = prefill_tokens
        else:
            wait = np.zeros(engines)
            np.maximum.at(wait, engine[going], latency[going, t - 1])
            clock += wait
            total["idle_seconds"] += wait
            held[going] += answers[going, t - 1]
            prefill = np.bincount(engine[going], weights=answers[going, t - 1], minlength=engines)
        run = run_engines(engine[going], held[going], turn_tokens[going, t], engines, prefill, model, hw, c, tp, slots)
        last = turns[going] == t + 1
        finish[going[last]] = clock[engine[going[last]]] + run.finish_seconds[last]
        clock += run.engine_seconds
        held[going] += turn_tokens[going, t]
        for name in total:
            if name != "idle_seconds":
                total[name] += getattr(run, name)
    return DecodeRun(finish_seconds=finish, **{k: (v.astype(np.int64) if k == "steps" else v) for k, v in total.items()})


class _AsyncEngine:
    """One engine serving trajectories asynchronously: an event loop over turn ends and answer arrivals.

    Between two events the active batch is fixed, so a stretch of decode steps is priced in closed form
    (`cost.decode_segment_seconds`, as `decode.py` and the streaming schedule do); a returning trajectory
    joins at the first step boundary after its answer arrives, its answer prefilled in one forward with any
    other arrivals of that boundary."""

    STATS = ("prefill_seconds", "decode_seconds", "idle_seconds", "steps", "token_steps", "kv_token_steps",
             "compute_bound_steps", "prefill_tokens")

    def __init__(self, members: np.ndarray, context: np.ndarray, turn_tokens: np.ndarray, answers: np.ndarray,
                 latency: np.ndarray, prompt_tokens: float, model: ModelSpec, hw: Hardware, c: CostConstants, tp: int,
                 slots: int):
        self.members = members
        self.held = {int(s): float(context[s]) for s in members}  # tokens before each one's current turn
        self.turn = dict.fromkeys(self.held, 0)
        self.turn_tokens, self.answers, self.latency = turn_tokens, answers, latency
        self.turns = {s: int((turn_tokens[s] > 0).sum()) for s in self.held}
        self.model, self.hw, self.c, self.tp, self.slots = model, hw, c, tp, slots
        self.queue = deque(self.held)  # trajectories not started
        self.back: deque[int] = deque()  # answered, waiting for a slot
        self.waiting: list[tuple[float, int]] = []  # (answer time, trajectory)
        self.active: list[tuple[int, int]] = []  # (step its turn ends, trajectory)
        self.steps, self.kv, self.time = 0, 0.0, 0.0
        self.end: dict[int, float] = {}
        for name in self.STATS:
            setattr(self, name, 0.0)
        if prompt_tokens > 0:
            self._prefill(prompt_tokens)

    @property
    def finish(self) -> np.ndarray:
        return np.array([self.end[int(s)] for s in self.members])

    def run(self) -> _AsyncEngine:
        while True:
            while self.waiting and self.waiting[0][0] <= self.time:  # answers in: back to the queue's front
                self.back.append(heapq.heappop(self.waiting)[1])
            self._admit()
            if not self.active and not self.waiting:
                return self
            if not self.active:  # every trajectory waits for an answer
                arrival = self.waiting[0][0]
                self.idle_seconds += arrival - self.time
                self.time = arrival
                continue
            horizon = self.active[0][0] - self.steps
            turn_end = self.time + cost.decode_stretch_seconds(horizon, len(self.active), self.kv, self.model,
                                                               self.hw, self.c, self.tp)
            if self.waiting and self.waiting[0][0] < turn_end:  # decode to the first step boundary after it
                self._decode(min(self._steps_until(horizon, self.waiting[0][0] - self.time) + 1, horizon))
            else:
                self._decode(horizon)
            self._end_turns()

    def _prefill(self, tokens: float) -> None:
        seconds = float(cost.prefill_seconds(tokens, self.model, self.hw, self.c, self.tp)) \
            + cost.step_fixed_seconds(self.model, self.c)
        self.prefill_seconds += seconds
        self.prefill_tokens += tokens
        self.time += seconds

    def _admit(self) -> None:
        """Fill free slots: answered trajectories first (their answers prefilled together), then new ones."""
        answered = 0.0
        while len(self.active) < self.slots and (self.back or self.queue):
            if self.back:
                s = self.back.popleft()
                tokens = float(self.answers[s, self.turn[s] - 1])
                self.held[s] += tokens
                answered += tokens
            else:
                s = self.queue.popleft()
            self.kv += self.held[s]
            heapq.heappush(self.active, (self.steps + int(self.turn_tokens[s, self.turn[s]]), s))
        if answered:
            self._prefill(answered)

    def _steps_until(self, horizon: int, seconds: float) -> int:
        """Most decode steps (< horizon) the active batch finishes within `seconds` (bisection on the closed form)."""
        low, high = 0, horizon - 1
        while low < high:
            mid = (low + high + 1) // 2
            if cost.decode_stretch_seconds(mid, len(self.active), self.kv, self.model, self.hw, self.c,
                                           self.tp) <= seconds:
                low = mid
            else:
                high = mid - 1
        return low

    def _decode(self, steps: int) -> None:
        active = len(self.active)
        seconds, compute = cost.decode_stretch(steps, active, self.kv, self.model, self.hw, self.c, self.tp)
        self.decode_seconds += seconds
        self.compute_bound_steps += compute
        self.time += seconds
        self.token_steps += active * steps
        self.kv_token_steps += steps * self.kv + active * steps * (steps - 1) / 2
        self.kv += active * steps
        self.steps += steps

    def _end_turns(self) -> None:
        """Trajectories whose turn ended at this step leave the batch: to wait for an answer, or done."""
        while self.active and self.active[0][0] == self.steps:
            _, s = heapq.heappop(self.active)
            t = self.turn[s]
            self.kv -= self.held[s] + float(self.turn_tokens[s, t])
            self.held[s] += float(self.turn_tokens[s, t])
            self.turn[s] = t + 1
            if t + 1 < self.turns[s]:
                heapq.heappush(self.waiting, (self.time + float(self.latency[s, t]), s))
            else:
                self.end[s] = self.time
