"""`textarena` games as environments (`textarena:<ID>`, e.g. `textarena:GuessTheNumber-v0`).

textarena (`pip install 'gcore-rl[agents]'`; tested: 0.7.4) registers about a hundred text games. Only
single-player games are served here (a game that needs more players is refused when the job is checked), and
only games that download nothing (GuessTheNumber-v0, FrozenLake-v0, TowerOfHanoi-v0, Minesweeper-v0, ... ;
Wordle, Hangman and Codenames call `nltk.download`, which has no network at run time).

The game is built with `textarena.make(ID, **options)` (the options override the registered constructor
arguments, e.g. `{max_number: 8, max_turns: 4}` for GuessTheNumber) and used without textarena's LLM wrappers:
the policy writes the move in the game's own format (e.g. `[5]`), and each turn's answer is the game's new
messages, one user message. textarena games draw from Python's global `random`, seeded at reset; each game
here keeps its own copy of that state, so episodes played side by side in one process stay deterministic.
textarena scores an episode when it ends (`close()`): that reward is the last turn's; earlier turns get 0.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from gcore_rl.agents.environments import AGENTS_EXTRA, EnvStep, Message
from gcore_rl.configlib import load_callable
from gcore_rl.errors import ConfigError

PREFIX = "textarena:"


def import_textarena(key: str) -> Any:
    """The `textarena` package, or ConfigError naming `key` and the extra that installs it."""
    try:
        return importlib.import_module("textarena")
    except ImportError as exc:
        raise ConfigError(key, f"names a textarena game, and the textarena package is not installed ({exc}); "
                          f"install the agents extra: {AGENTS_EXTRA}") from None


def resolve(game: str, options: Mapping[str, Any], key: str) -> Callable[[], TextArenaGame]:
    """The factory of textarena game `game` with `options` (ConfigError naming `key` for an unknown game, options
    it does not take, or a game that is not single-player: one game is built and reset to find out)."""
    ta = import_textarena(key)
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        close = difflib.get_close_matches(game, list(ENV_REGISTRY), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(key, f"'{PREFIX}{game}' names no textarena game{hint}")
    try:
        probe = TextArenaGame(ta, game, options)
    except Exception as exc:
        raise ConfigError(key, f"the textarena game {game} cannot be built with the options {dict(options)} "
                          f"({type(exc).__name__}: {exc})") from None
    try:
        probe.reset({"seed": 0})
    except Exception as exc:
        raise ConfigError(key, f"the textarena game {game} cannot be played by one player ({type(exc).__name__}: "
                          f"{exc}); only single-player games are served") from None
    return lambda: TextArenaGame(ta, game, options)


class TextArenaGame:
    """One single-player textarena game (the `Environment` protocol)."""

    def __init__(self, ta: Any, game: str, options: Mapping[str, Any]):
        env = ta.make(game, **dict(options))
        while hasattr(env, "env"):  # textarena's LLM wrappers: the game keeps the raw messages
            env = env.env
        self.env, self.game = env, game
        self.random_state: Any = None
        self.player = 0

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """Python's global `random` as this game left it, for one call (the process's own state is restored)."""
        outside = random.getstate()
        if self.random_state is not None:
            random.setstate(self.random_state)
        try:
            yield
        finally:
            self.random_state = random.getstate()
            random.setstate(outside)

    def reset(self, spec: Mapping[str, Any]) -> list[Message]:
        with self._own_random():
            self.env.reset(num_players=1, seed=spec.get("seed"))
            self.player, observations = self.env.get_observation()
        return [{"role": "user", "content": self._text(observations)}]

    def step(self, reply: str) -> EnvStep:
        with self._own_random():
            done, _ = self.env.step(reply)
            if done:
                rewards, _ = self.env.close()
                return EnvStep(reward=float(rewards.get(self.player, 0.0)), done=True)
            self.player, observations = self.env.get_observation()
        return EnvStep(messages=[{"role": "user", "content": self._text(observations)}])

    def close(self) -> None:
        pass

    def _text(self, observations: list[tuple[int, str, Any]]) -> str:
        """The game's messages to the player (its own move, which textarena echoes, left out), one per line."""
        return "\n".join(text for sender, text, _ in observations if sender != self.player).strip()


def textarena_rows(game: str, num_rows: int, seed: int, options: Mapping[str, Any] | None = None,
                   indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Prompt rows of textarena game `game`: row i opens an episode seeded `seed * 1_000_003 + i` (its global
    index, so controllers building only their own rows agree): `{"messages": [the opening], "env": {"name",
    "seed", "options"}, "task"}`; the chat template renders the opening into the prompt.

    With the option `play` (the import path of a scripted player, `gcore_rl.agents.players`), each row is instead
    a whole episode that player played (its moves as assistant turns, the game's answers as user turns, ending
    with its last move) with the game's reward in `env_reward`: warm-start traces for `gcore-rl sft`."""
    options = dict(options or {})
    player = options.pop("play", None)
    factory = resolve(game, options, "data.task")
    play = load_callable(player, "data.task_options.play") if player is not None else None
    rows = []
    for index in (indices if indices is not None else range(num_rows)):
        spec = {"name": PREFIX + game, "seed": seed * 1_000_003 + index, "options": options}
        env = factory()
        row: dict[str, Any] = {"messages": env.reset(spec), "env": spec, "task": PREFIX + game}
        if play is not None:
            row["env_reward"] = _play_episode(env, play, row["messages"], random.Random(f"player {spec['seed']}"))  # not the game's own stream
            del row["env"]  # a trace is trained on, not played
        rows.append(row)
    return rows


MAX_TRACE_TURNS = 100
"""Most moves a scripted player makes in one trace (a game that never ends is cut there)."""


def _play_episode(env: TextArenaGame, play: Callable[..., str], messages: list[Message], rng: random.Random) -> float:
    """Play `env` from its opening `messages` with `play` (appending the moves and answers); the episode's reward."""
    total = 0.0
    for _ in range(MAX_TRACE_TURNS):
        move = play(messages, rng)
        messages.append({"role": "assistant", "content": move})
        outcome = env.step(move)
        total += outcome.reward
        if outcome.done:
            break
        messages.extend(outcome.messages)
    while messages[-1]["role"] != "assistant":  # a trace ends with a move to train on
        messages.pop()
    return total
