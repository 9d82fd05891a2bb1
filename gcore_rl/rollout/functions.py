"""Rollout functions: what runs on a device worker beside its engine to turn prompts into trained samples.

A rollout function takes a `RolloutRequest` (the engine, the prompts' token ids, the sampling settings, a
seed, the policy's tokenizer and the function's `rollout.options`) and yields lists of `Completion`s as
they finish, `sampling.n` per prompt, each `(prompt_index, sample_index)` once. It may call the engine as
often as it likes: a multi-turn function generates a turn, appends what a tool or an environment answers
(`RolloutEngine.continue_stream` reads the ids as they are, no re-tokenisation), and generates again. Each
completion carries every token after the prompt -- the policy's and the inserted ones -- with a log-prob
per token and a `loss_mask` (1 = the policy sampled it, 0 = inserted, with log-prob 0); the trainer counts
only the policy's tokens (`records.build_token_batch`). Functions are named by import path
(`rollout.function`), as slime's custom generate function and verl's agent loop are; `single_turn` is the
default: one engine call, every token the policy's. A function may carry a `check_options(options, tokenizer)`
attribute, which the driver calls with the policy's tokenizer before any process starts (`check_rollout`),
a `prompt_tools(options)` attribute: the JSON schemas of the tools it offers, which chat prompts are
rendered with (`prompt_tools`), and a `close()` attribute, which a device worker calls when it closes. An
exception a job's own function raises becomes a one-paragraph `RolloutError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gcore_rl.configlib import check_import_path, load_callable
from gcore_rl.errors import GcoreError, RolloutError
from gcore_rl.records import Completion
from gcore_rl.rollout.protocol import RolloutEngine
from gcore_rl.rollout.sampling import SamplingConfig

SINGLE_TURN = "gcore_rl.rollout.functions:single_turn"


@dataclass
class RolloutConfig:
    """The function that makes each prompt's samples."""

    function: str = field(default=SINGLE_TURN, metadata={"help": "Import path `package.module:function` of the rollout function run on each rollout device beside its engine (gcore_rl/rollout/functions.py says what it is given and must return); the default generates each sample in one engine call."})
    options: dict[str, Any] = field(default_factory=dict, metadata={"help": "Keyword options handed to the rollout function as `request.options` (what they mean is the function's business)."})

    def validate(self) -> None:
        check_import_path(self.function, "function")


@dataclass(frozen=True)
class RolloutRequest:
    """What a rollout function is given: `params.n` samples of each of `prompts` are wanted (token ids, a
    `VisionPrompt` with its images), drawn with `seed`; `tokenizer` is the policy's, `options` the
    `rollout.options` of the job, `context` the longest sequence the policy accepts (None: not known)."""

    engine: RolloutEngine
    prompts: Sequence[Sequence[int]]
    params: SamplingConfig
    seed: int
    tokenizer: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)
    context: int | None = None  # the longest sequence the policy accepts (prompt included), when known


RolloutFunction = Callable[[RolloutRequest], Iterator[list[Completion]]]


def single_turn(request: RolloutRequest) -> Iterator[list[Completion]]:
    """The default: one engine call; every token of a completion is the policy's (no loss mask)."""
    yield from request.engine.generate_stream(request.prompts, request.params, seed=request.seed)


def load_rollout_function(cfg: RolloutConfig, key: str = "rollout.function") -> RolloutFunction:
    """The function `cfg.function` names (ConfigError naming `key`, its dotted config key, when it cannot be
    imported)."""
    return load_callable(cfg.function, key)


def check_rollout(cfg: RolloutConfig, tokenizer: Any = None) -> RolloutFunction:
    """The job's rollout function, with its options checked where it can check them: a function that has a
    `check_options(options, tokenizer)` attribute (`tokenizer`: the policy's, with the job's chat template)
    raises ConfigError for bad options before any process starts."""
    fn = load_rollout_function(cfg)
    check = getattr(fn, "check_options", None)
    if check is not None:
        check(cfg.options, tokenizer)
    return fn


def prompt_tools(cfg: RolloutConfig) -> list[dict[str, Any]]:
    """JSON schemas of the tools the job's rollout function offers the policy, for the chat template to render
    into chat prompts: what its `prompt_tools(options)` attribute returns, none without one."""
    offer = getattr(load_rollout_function(cfg), "prompt_tools", None)
    return list(offer(cfg.options)) if offer is not None else []


def _named_failures(chunks: Iterator[list[Completion]], name: str) -> Iterator[list[Completion]]:
    """`chunks`, with an exception a job's own rollout function raises turned into a one-paragraph RolloutError
    (the default function's failures are the engine's, and keep their kind)."""
    if name == SINGLE_TURN:
        yield from chunks
        return
    try:
        yield from chunks
    except GcoreError:
        raise
    except Exception as exc:
        raise RolloutError(f"rollout function {name} raised {type(exc).__name__}: {exc}") from exc


def checked_rollout(chunks: Iterator[list[Completion]], prompts: int, n: int, name: str) -> Iterator[list[Completion]]:
    """`chunks` passed through, each completion held to the contract (RolloutError naming the function `name`
    otherwise): lengths agree, inserted tokens carry log-prob 0, every `(prompt, sample)` in range and once,
    and all `prompts * n` of them by the end."""
    seen: set[tuple[int, int]] = set()
    for chunk in _named_failures(chunks, name):
        for c in chunk:
            key = (c.prompt_index, c.sample_index)
            problem = None
            if not (0 <= c.prompt_index < prompts and 0 <= c.sample_index < n):
                problem = f"returned sample {key} of a request for {n} samples of {prompts} prompts"
            elif key in seen:
                problem = f"returned sample {key} twice"
            else:
                try:
                    c.check()
                except ValueError as exc:
                    problem = str(exc)
            if problem:
                raise RolloutError(f"rollout function {name}: {problem}")
            seen.add(key)
        yield chunk
    if len(seen) != prompts * n:
        raise RolloutError(f"rollout function {name}: returned {len(seen)} samples, {prompts * n} were asked for "
                           f"({n} for each of {prompts} prompts)")
