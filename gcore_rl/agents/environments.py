"""Environments a policy plays turn by turn: the interface, and how a data row names one.

An environment keeps its state in the rollout process. `reset(spec)` starts an episode from the `env` column
of a data row (a mapping: at least `name`, plus what the environment reads, such as a `seed`) and returns the
episode's opening messages; `step(reply)` takes the text of the policy's turn and returns `EnvStep`: the
messages that answer it (most often one user message), a reward for that turn, and whether the episode is
over. Rewards may come every turn or only at the end; `gcore_rl.agents.env_turns` credits each to the turn
it answers.

`reset` must be deterministic given the spec: the data task renders the opening messages into the row's
prompt when the data is built, and the rollout process resets its own copy from the same spec.

A name is either `textarena:<ID>` (a single-player `textarena` game, `gcore_rl.agents.textarena_env`; the
`agents` extra installs it) or the import path `package.module:factory` of a callable
`factory(**options) -> Environment` (a class works), with `options` the spec's `options` mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gcore_rl.configlib import check_import_path, load_callable
from gcore_rl.errors import ConfigError

Message = dict[str, str]
"""A chat message: `{"role": "user" | "system" | ..., "content": str}`."""


@dataclass(frozen=True)
class EnvStep:
    """What an environment answers a turn with: its messages, the turn's reward, and whether the episode ended."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """A turn-based environment (see the module docstring)."""

    def reset(self, spec: Mapping[str, Any]) -> list[Message]:
        """Start an episode from a row's `env` spec; the opening messages."""
        ...

    def step(self, reply: str) -> EnvStep:
        """The answer to the policy's turn `reply` (its text, special tokens dropped)."""
        ...

    def close(self) -> None:
        """Release what the episode holds."""
        ...


AGENTS_EXTRA = "pip install 'gcore-rl[agents]'"

FAMILIES: dict[str, str] = {"textarena": "gcore_rl.agents.textarena_env:resolve"}
"""Environment families by name prefix (`textarena:ID`): the import path of `resolve(rest, options, key)`, which
returns the factory of the environment the rest of the name names."""


def environment_factory(name: str, options: Mapping[str, Any] | None = None,
                        key: str = "env.name") -> Callable[[], Environment]:
    """A callable that makes a fresh environment `name` with `options` (ConfigError naming `key` when the name
    cannot be resolved: an unknown family, a missing package with the extra to install, a bad import path)."""
    options = dict(options or {})
    family, _, rest = name.partition(":")
    if family in FAMILIES:
        return load_callable(FAMILIES[family], key)(rest, options, key)
    check_import_path(name, key)
    factory = load_callable(name, key)
    return lambda: factory(**options)


def spec_name(spec: Any, where: str) -> tuple[str, dict[str, Any]]:
    """The environment name and options of a row's `env` spec (ConfigError naming `where` when it is no mapping
    with a string `name` and a mapping `options`)."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ConfigError(where, f"must be a mapping with the environment's `name` (and its `seed`, `options`), got {spec!r}")
    options = spec.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where}.options", f"must be a mapping of the environment's options, got {options!r}")
    return spec["name"], dict(options)
