"""Rule-based rewards: user or built-in Python functions combined by weight.

A rule reward is any callable ``fn(prompt, completion, **row) -> float`` referenced in the config
by its import path ``"package.module:function"`` (a dotted attribute path after the colon, such
as ``"module:Class.method"``, also works). `row` is the prompt row without its ``prompt`` (and
without a ``completion`` column, should the data have one), so ``answer`` and any extra columns
arrive as keyword arguments.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gcore_rl.errors import ConfigError, RewardError
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
        check_import_path(self.fn, "fn")
        if not math.isfinite(self.weight):
            raise ConfigError("weight", f"must be a finite number, got {self.weight}")


def _default_rules() -> list[RewardFnConfig]:
    return [RewardFnConfig()]


@dataclass
class RewardConfig:
    """How completions are scored: weighted rule rewards, error policy and the accuracy metric."""

    rules: list[RewardFnConfig] = field(
        default_factory=_default_rules,
        metadata={"help": "Rule reward functions; a sample's reward is the weighted sum of their values."},
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

    def validate(self) -> None:
        if not self.rules:
            raise ConfigError("rules", "needs at least one reward function")
        for i, rule in enumerate(self.rules):
            try:
                rule.validate()
            except ConfigError as exc:
                raise exc.with_prefix(f"rules.{i}") from None
        if self.on_error not in ("raise", "assign"):
            raise ConfigError("on_error", f"must be 'raise' or 'assign', got {self.on_error!r}")
        if not math.isfinite(self.error_value):
            raise ConfigError("error_value", f"must be a finite number, got {self.error_value}")
        if self.accuracy_fn is not None:
            check_import_path(self.accuracy_fn, "accuracy_fn")


def check_import_path(path: str, key: str) -> tuple[str, str]:
    """Split `module:attr`, raising ConfigError(key) unless there is exactly one ':' with text on both sides."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ConfigError(key, f"`{path}` is not an import path of the form `package.module:function`")
    module_name, attr = path.split(":")
    if not module_name.strip() or not attr.strip():
        raise ConfigError(key, f"`{path}` is not an import path of the form `package.module:function`")
    return module_name.strip(), attr.strip()


def load_callable(path: str, key: str) -> Callable[..., Any]:
    """Import and return the callable named by ``"module:function"``.

    Raises ConfigError(key, ...) naming `path` when the format is wrong, the module cannot be
    imported, the attribute does not exist, or it is not callable.
    """
    module_name, attr = check_import_path(path, key)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(key, f"cannot import `{path}`: module `{module_name}` not found") from exc
        raise ConfigError(key, f"cannot import `{path}`: importing `{module_name}` failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(key, f"cannot import `{path}`: importing `{module_name}` raised {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(key, f"cannot import `{path}`: `{module_name}` has no attribute `{attr}`") from None
    if not callable(obj):
        raise ConfigError(key, f"`{path}` is not callable (it is a {type(obj).__name__})")
    return obj


@dataclass
class RewardOutput:
    """Scores of a batch of samples (all lists aligned with the input order).

    `rewards` are the weighted sums; `per_fn` maps each rule's import path (suffixed ``#2``,
    ``#3``... for repeats) to its unweighted values; `accuracy` holds the accuracy function's
    values (None when none is configured). With ``on_error: assign`` a sample on which any rule
    fails gets `error_value` as its total reward (and as that rule's `per_fn` entry), a failed
    accuracy call gives accuracy 0.0, and `error_count` is the number of samples on which at
    least one function (rule or accuracy) failed.
    """

    rewards: list[float]
    accuracy: list[float] | None
    per_fn: dict[str, list[float]]
    error_count: int


class _Failure(Exception):
    """Internal: a reward function failed on one sample (cause already formatted)."""

    def __init__(self, cause: str, exc: BaseException | None = None):
        super().__init__(cause)
        self.cause = cause
        self.exc = exc


def _shorten(text: str) -> str:
    return text if len(text) <= _TRUNCATE else text[:_TRUNCATE] + "..."


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


class RuleRewards:
    """Scores completions with the weighted rule functions of a `RewardConfig`.

    Functions are imported once at construction (a bad import path raises ConfigError with keys
    like ``rules.0.fn`` or ``accuracy_fn``). When the accuracy function is also one of the rules,
    its values are reused rather than computed twice.
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

    @property
    def fn_names(self) -> list[str]:
        """Keys of `RewardOutput.per_fn`, in rule order."""
        return [name for name, _, _, _ in self._rules]

    def _call(self, path: str, fn: Callable[..., Any], index: int, sample: RewardInput) -> float | None:
        """Value of `fn` on `sample`; None on failure with on_error='assign'."""
        kwargs = {k: v for k, v in sample.row.items() if k not in ("prompt", "completion")}
        try:
            try:
                value = fn(sample.prompt, sample.completion, **kwargs)
            except Exception as exc:
                raise _Failure(f"raised {type(exc).__name__}: {exc}", exc) from exc
            return _to_float(value)
        except _Failure as failure:
            if self.cfg.on_error == "assign":
                return None
            raise RewardError(
                f"reward function `{path}` failed on sample {index} "
                f"(prompt {_shorten(sample.prompt)!r}, completion {_shorten(sample.completion)!r}): {failure.cause}. "
                "Fix the function, or set `on_error: assign` in the reward config to give such samples `error_value`."
            ) from failure.exc

    def __call__(self, samples: Sequence[RewardInput]) -> RewardOutput:
        n = len(samples)
        reward_failed = [False] * n  # some rule failed: the sample's reward becomes error_value
        per_fn: dict[str, list[float]] = {}
        by_path: dict[str, tuple[list[float], list[bool]]] = {}
        rewards = [0.0] * n
        for name, path, weight, fn in self._rules:
            values: list[float] = []
            fn_failed = [False] * n
            for i, sample in enumerate(samples):
                value = self._call(path, fn, i, sample)
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
                    value = self._call(acc_path, self._accuracy_fn, i, sample)
                    if value is None:
                        failed[i] = True
                        value = 0.0
                    accuracy.append(value)
        for i in range(n):
            if reward_failed[i]:
                rewards[i] = self.cfg.error_value
        return RewardOutput(rewards=rewards, accuracy=accuracy, per_fn=per_fn, error_count=sum(failed))
