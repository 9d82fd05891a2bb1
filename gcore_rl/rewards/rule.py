"""Rule-based rewards: user or built-in Python functions combined by weight.

A rule reward is any callable ``fn(prompt, completion, **row) -> float`` (for a diffusion policy the
completion is the image, a ``[H, W, 3]`` array in [0, 1]: see `gcore_rl.rewards.image`) referenced in the config
by its import path ``"package.module:function"`` (a dotted attribute path after the colon, such
as ``"module:Class.method"``, also works). `row` is the prompt row without its ``prompt`` (and
without a ``completion`` column, should the data have one), so ``answer`` and any extra columns
arrive as keyword arguments.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gcore_rl.configlib import load_callable
from gcore_rl.errors import ConfigError, RewardError
from gcore_rl.rewards.ecosystem import check_reward_path
from gcore_rl.rewards.pool import CallResult, TimedPool

if TYPE_CHECKING:  # not at run time: the pool's workers import this module and need no torch
    from gcore_rl.records import RewardInput

_TRUNCATE = 200


@dataclass
class RewardFnConfig:
    """One rule reward function and its weight in the total reward."""

    fn: str = field(
        default="gcore_rl.rewards.builtin:exact_match",
        metadata={"help": "Import path `module:function` of a callable fn(prompt, completion, **row) -> float."},
    )
    weight: float = field(default=1.0, metadata={"help": "Multiplier of this function's value in the summed reward."})

    def validate(self) -> None:
        check_reward_path(self.fn, "fn")
        if not math.isfinite(self.weight):
            raise ConfigError("weight", f"must be a finite number, got {self.weight}")


def default_rules() -> list[RewardFnConfig]:
    return [RewardFnConfig()]


@dataclass
class RewardConfig:
    """How completions are scored: weighted rule rewards, error policy and the accuracy metric."""

    rules: list[RewardFnConfig] = field(
        default_factory=default_rules,
        metadata={"help": "Rule reward functions; a sample's reward is the weighted sum of their values (empty: none, when a judge, a reward model or an environment gives the reward)."},
    )
    on_error: Literal["raise", "assign"] = field(
        default="raise",
        metadata={"help": "When a reward function raises or returns a non-number/NaN/inf: stop the run (raise) or give the sample `error_value` and count it (assign)."},
    )
    error_value: float = field(
        default=0.0, metadata={"help": "Reward given to a sample whose reward computation failed when on_error is 'assign'."}
    )
    accuracy_fn: str | None = field(
        default="gcore_rl.rewards.builtin:exact_match",
        metadata={"help": "Import path `module:function` scored and reported as the `accuracy` metric (null: no accuracy)."},
    )
    workers: int = field(
        default=0, metadata={"help": "Processes that run the rule and accuracy functions, each call limited to timeout_s (0 = call them in the controller's own process, where no time limit applies)."})
    timeout_s: float = field(
        default=10.0, metadata={"help": "With workers >= 1: seconds one call of a reward function may take; the worker of a call that overruns is killed and replaced, and on_timeout decides the sample's value."})
    on_timeout: Literal["error", "zero"] = field(
        default="error", metadata={"help": "When a call overruns timeout_s: stop the run naming the function and the sample (error), or score that function 0 on the sample and count the sample in the `reward/timeouts` metric (zero)."})
    overlong_buffer: int = field(
        default=0, metadata={"help": "DAPO soft overlong punishment: the last this many tokens before sampling.max_new_tokens form a buffer in which a linear length penalty, 0 at its start and -overlong_penalty at max_new_tokens, is added to the reward (0 = off; must be below max_new_tokens). See gcore_rl/rewards/overlong.py."})
    overlong_penalty: float = field(
        default=1.0, metadata={"help": "Size of the soft overlong punishment at max_new_tokens (the penalty reaches -overlong_penalty); used when overlong_buffer > 0."})

    def validate(self) -> None:
        for i, rule in enumerate(self.rules):
            try:
                rule.validate()
            except ConfigError as exc:
                raise exc.with_prefix(f"rules.{i}") from None
        if self.on_error not in ("raise", "assign"):
            raise ConfigError("on_error", f"must be 'raise' or 'assign', got {self.on_error!r}")
        if not math.isfinite(self.error_value):
            raise ConfigError("error_value", f"must be a finite number, got {self.error_value}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ConfigError("workers", f"must be an integer >= 0 (0 = score in-process), got {self.workers!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError("timeout_s", f"must be a finite number of seconds > 0, got {self.timeout_s}")
        if self.on_timeout not in ("error", "zero"):
            raise ConfigError("on_timeout", f"must be 'error' or 'zero', got {self.on_timeout!r}")
        if self.overlong_buffer < 0:
            raise ConfigError("overlong_buffer", f"must be >= 0 tokens (0 = no overlong punishment), got {self.overlong_buffer}")
        if not (math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0):
            raise ConfigError("overlong_penalty", f"must be a finite number >= 0 (the size of a penalty), got {self.overlong_penalty}")
        if self.accuracy_fn is not None:
            check_reward_path(self.accuracy_fn, "accuracy_fn")


@dataclass
class RewardOutput:
    """Scores of a batch of samples (all lists aligned with the input order).

    `rewards` are the weighted sums; `per_fn` maps each rule's import path (suffixed ``#2``,
    ``#3``... for repeats) to its unweighted values; `accuracy` holds the accuracy function's
    values (None when none is configured). With ``on_error: assign`` a sample on which any rule
    fails gets `error_value` as its total reward (and as that rule's `per_fn` entry), a failed
    accuracy call gives accuracy 0.0, and `error_count` is the number of samples on which at
    least one function (rule or accuracy) failed. `timeout_count` is the number of samples on which
    a call overran `timeout_s` under ``on_timeout: zero`` (that function's value is 0.0 there).
    """

    rewards: list[float]
    accuracy: list[float] | None
    per_fn: dict[str, list[float]]
    error_count: int
    timeout_count: int = 0


class _Failure(Exception):
    """Internal: a reward function failed on one sample (cause already formatted)."""

    def __init__(self, cause: str, exc: BaseException | None = None):
        super().__init__(cause)
        self.cause = cause
        self.exc = exc


def _shorten(text: str) -> str:
    return text if len(text) <= _TRUNCATE else text[:_TRUNCATE] + "..."


def _describe(completion: Any) -> str:
    """A completion as an error message shows it: shortened text, or an image by its shape."""
    if isinstance(completion, str):
        return repr(_shorten(completion))
    return f"image {list(getattr(completion, 'shape', []))}"


def _to_float(value: Any) -> float:
    """Convert a reward function's return value to a finite float or raise _Failure."""
    if isinstance(value, numbers.Real):
        result = float(value)
    elif hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:  # one-element tensor
        result = float(value.item())
    else:
        raise _Failure(f"returned {type(value).__name__} {_shorten(repr(value))}, expected a number")
    if not math.isfinite(result):
        raise _Failure(f"returned a non-finite value ({result})")
    return result


@dataclass(frozen=True)
class _Outcome:
    """One call of a reward function on one sample: its value, or why it has none."""

    value: float | None
    cause: str | None = None
    exc: BaseException | None = None  # the function's own exception (in-process calls only)
    timed_out: bool = False


def _fn_kwargs(sample: RewardInput) -> dict[str, Any]:
    return {k: v for k, v in sample.row.items() if k not in ("prompt", "completion")}


def _outcome(fn: Callable[..., Any], prompt: str, completion: str, kwargs: dict[str, Any]) -> _Outcome:
    try:
        try:
            value = fn(prompt, completion, **kwargs)
        except Exception as exc:
            raise _Failure(f"raised {type(exc).__name__}: {exc}", exc) from exc
        return _Outcome(_to_float(value))
    except _Failure as failure:
        return _Outcome(None, failure.cause, failure.exc)


_WORKER_FNS: dict[str, Callable[..., Any]] = {}
"""Functions imported by this pool worker process, by import path."""


def _call_in_worker(path: str, prompt: str, completion: str, kwargs: dict[str, Any]) -> tuple[float | None, str | None]:
    """Runs in a pool worker: import `path` once per process, call it; (value, None) or (None, cause)."""
    if path not in _WORKER_FNS:
        _WORKER_FNS[path] = load_callable(path, "fn")
    outcome = _outcome(_WORKER_FNS[path], prompt, completion, kwargs)
    return outcome.value, outcome.cause


def _from_pool(result: CallResult) -> _Outcome:
    if result.timed_out:
        return _Outcome(None, timed_out=True)
    if result.failure is not None:
        return _Outcome(None, result.failure)
    value, cause = result.value
    return _Outcome(value, cause)


class RuleRewards:
    """Scores completions with the weighted rule functions of a `RewardConfig`.

    Functions are imported once at construction (a bad import path raises ConfigError with keys
    like ``rules.0.fn`` or ``accuracy_fn``). When the accuracy function is also one of the rules,
    its values are reused rather than computed twice, and a function listed twice is called once.
    With ``workers >= 1`` the calls run in a `TimedPool` started on the first batch; `close` (or
    leaving a ``with`` block) stops it, and must be called on every way out of a run.
    """

    def __init__(self, cfg: RewardConfig):
        cfg.validate()
        self.cfg = cfg
        self._rules: list[tuple[str, str, float, Callable[..., Any]]] = []
        seen: dict[str, int] = {}
        for i, rule in enumerate(cfg.rules):
            fn = load_callable(rule.fn, f"rules.{i}.fn")
            seen[rule.fn] = seen.get(rule.fn, 0) + 1
            name = rule.fn if seen[rule.fn] == 1 else f"{rule.fn}#{seen[rule.fn]}"
            self._rules.append((name, rule.fn, float(rule.weight), fn))
        self._accuracy_fn = None if cfg.accuracy_fn is None else load_callable(cfg.accuracy_fn, "accuracy_fn")
        self._pool = TimedPool(cfg.workers, cfg.timeout_s) if cfg.workers > 0 else None

    @property
    def fn_names(self) -> list[str]:
        """Keys of `RewardOutput.per_fn`, in rule order."""
        return [name for name, _, _, _ in self._rules]

    def close(self) -> None:
        """Stop the worker processes, if any (idempotent)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RuleRewards:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _outcomes(self, samples: Sequence[RewardInput]) -> dict[str, list[_Outcome]]:
        """Every distinct function's outcome on every sample, by import path (all calls at once in the pool)."""
        fns = {path: fn for _, path, _, fn in self._rules}
        if self._accuracy_fn is not None and self.cfg.accuracy_fn is not None:
            fns.setdefault(self.cfg.accuracy_fn, self._accuracy_fn)
        if self._pool is None:
            return {path: [_outcome(fn, s.prompt, s.completion, _fn_kwargs(s)) for s in samples]
                    for path, fn in fns.items()}
        calls = [(path, s.prompt, s.completion, _fn_kwargs(s)) for path in fns for s in samples]
        results = iter(self._pool.map(_call_in_worker, calls))
        return {path: [_from_pool(next(results)) for _ in samples] for path in fns}

    def _settle(self, path: str, index: int, sample: RewardInput, outcome: _Outcome) -> float | None:
        """The value to use for `outcome`: 0.0 for a timeout under on_timeout='zero', None for a failure
        under on_error='assign'; otherwise a failure or timeout raises RewardError."""
        where = f"on sample {index} (prompt {_shorten(sample.prompt)!r}, completion {_describe(sample.completion)})"
        if outcome.timed_out:
            if self.cfg.on_timeout == "zero":
                return 0.0
            raise RewardError(
                f"reward function `{path}` did not return within reward.timeout_s={self.cfg.timeout_s:g} s {where}; "
                "its worker process was killed. Make the function faster, raise reward.timeout_s, or set "
                "reward.on_timeout=zero to score such calls 0 and count them in the reward/timeouts metric.")
        if outcome.value is not None:
            return outcome.value
        if self.cfg.on_error == "assign":
            return None
        raise RewardError(
            f"reward function `{path}` failed {where}: {outcome.cause}. "
            "Fix the function, or set `on_error: assign` in the reward config to give such samples `error_value`."
        ) from outcome.exc

    def __call__(self, samples: Sequence[RewardInput]) -> RewardOutput:
        n = len(samples)
        outcomes = self._outcomes(samples)
        reward_failed = [False] * n  # some rule failed: the sample's reward becomes error_value
        timed_out = [False] * n
        per_fn: dict[str, list[float]] = {}
        by_path: dict[str, tuple[list[float], list[bool]]] = {}
        rewards = [0.0] * n
        for name, path, weight, _ in self._rules:
            values: list[float] = []
            fn_failed = [False] * n
            for i, sample in enumerate(samples):
                value = self._settle(path, i, sample, outcomes[path][i])
                timed_out[i] = timed_out[i] or outcomes[path][i].timed_out
                if value is None:
                    fn_failed[i] = reward_failed[i] = True
                    value = self.cfg.error_value
                values.append(value)
                rewards[i] += weight * value
            per_fn[name] = values
            by_path.setdefault(path, (values, fn_failed))
        failed = list(reward_failed)
        accuracy: list[float] | None = None
        acc_path = self.cfg.accuracy_fn
        if self._accuracy_fn is not None and acc_path is not None:
            if acc_path in by_path:
                # reuse the rule's values; a failed call holds error_value, which is no accuracy
                values, fn_failed = by_path[acc_path]
                accuracy = [0.0 if bad else value for value, bad in zip(values, fn_failed, strict=True)]
            else:
                accuracy = []
                for i, sample in enumerate(samples):
                    value = self._settle(acc_path, i, sample, outcomes[acc_path][i])
                    timed_out[i] = timed_out[i] or outcomes[acc_path][i].timed_out
                    if value is None:
                        failed[i] = True
                        value = 0.0
                    accuracy.append(value)
        for i in range(n):
            if reward_failed[i]:
                rewards[i] = self.cfg.error_value
        return RewardOutput(rewards=rewards, accuracy=accuracy, per_fn=per_fn, error_count=sum(failed),
                            timeout_count=sum(timed_out))
