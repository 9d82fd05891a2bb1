"""Every config key's help string is reference text: what the key does, its unit and its range.

`gcore-rl config-reference` (and its `--sft`, `--rm`, `--flow-grpo`, `--flow-sft` variants) and the
simulator's `Scenario` print each field's ``metadata["help"]``. Why a default was chosen and what
an experiment measured belong in the docs, not there. For every key reachable from the root
configs below (nested sections, and dataclasses inside lists, dicts and unions) the help string

- exists and is not empty;
- is at most `MAX_HELP_CHARS` characters. 400 is two or three sentences, at most five lines of
  `describe`'s 96-column output: room for what a key does, its unit, range and default, and for
  the meaning of each value of a choice (`algo.advantage` lists seven). When the limit was set,
  half of the ~410 distinct fields' help was under 90 characters and 95 % under ~370; the dozen
  over 400 (up to 550) held explanation or measurements, and fit once those moved to the docs;
- holds no marks of history: ISO dates (``2026-11-24``), month-year dates (``Nov 2026``,
  ``11/2026``), commit-hash-like tokens (7 to 40 lowercase hex characters with both a digit and a
  letter a-f, e.g. ``44a7871``) or session numbers (``session 12``).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterator

import pytest

from gcore_rl.config import JobConfig
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.sim.scenario import Scenario
from gcore_rl.training.flow_sft import FlowSftConfig
from gcore_rl.training.reward_trainer import RewardTrainConfig
from gcore_rl.training.sft import SftConfig

ROOTS: tuple[type, ...] = (JobConfig, SftConfig, RewardTrainConfig, FlowGrpoJobConfig, FlowSftConfig, Scenario)
MAX_HELP_CHARS = 400

_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December"
           "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec")
HISTORY_PATTERNS: dict[str, re.Pattern[str]] = {
    "an ISO date": re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),
    # Capitalised month names only, so the verb "may" and words such as "mar" do not count.
    "a month-year date": re.compile(rf"\b(?:{_MONTHS})\.?\s+(?:\d{{1,2}}(?:st|nd|rd|th)?,?\s+)?(?:19|20)\d\d\b"
                                    r"|\b(?:0?[1-9]|1[0-2])/(?:19|20)\d\d\b"),
    # A whole word of lowercase hex with both a digit and a letter. Not a colour (`#a1b2c3d`), a
    # literal (`0x1f2e3d4`), a number (12845056: no letter) or a word (`deadbeef`: no digit).
    "a commit-hash-like token": re.compile(r"(?<![\w#])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?!\w)"),
    "a session number": re.compile(r"\bsessions?\s*(?:#|no\.?\s*)?\d+", re.IGNORECASE),
}


@dataclasses.dataclass(frozen=True)
class Key:
    path: str  # the dotted key as `describe` writes it, under its root config
    root: type
    owner: type  # the dataclass that declares the field
    field: dataclasses.Field

    @property
    def name(self) -> str:
        where = f"{self.owner.__module__}.{self.owner.__qualname__}.{self.field.name}"
        return f"{self.root.__name__}: {self.path} ({where})"

    @property
    def help(self) -> str:
        return str(self.field.metadata.get("help", "")).strip()


def _sections(tp: typing.Any, segment: str = "") -> Iterator[tuple[type, str]]:
    """Each dataclass an annotation's keys continue into, with the key segment that leads to it."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        yield tp, segment
        return
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not Ellipsis]
    if origin in (list, tuple):
        for arg in args:
            yield from _sections(arg, segment or "<i>")
    elif origin is dict:
        if args:
            yield from _sections(args[-1], segment or "<name>")
    else:  # unions (Optional included); Literal's values are no dataclasses and yield nothing
        for arg in args:
            yield from _sections(arg, segment)


def _walk(cls: type, root: type, prefix: str, stack: tuple[type, ...]) -> Iterator[Key]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}.{f.name}" if prefix else f.name
        yield Key(path, root, cls, f)
        for nested, segment in _sections(hints[f.name]):
            if nested not in (*stack, cls):
                yield from _walk(nested, root, f"{path}.{segment}" if segment else path, (*stack, cls))


def _first_of_each_field(keys: list[Key]) -> list[Key]:
    """Each declared field once, at the first path that reaches it.

    Sections shared by several roots count once, and so do fields a subclass inherits (a dataclass
    subclass holds its base's `Field` objects themselves).
    """
    first: dict[dataclasses.Field, Key] = {}
    for key in keys:
        first.setdefault(key.field, key)
    return list(first.values())


ALL_KEYS = [key for root in ROOTS for key in _walk(root, root, "", ())]
KEYS = _first_of_each_field(ALL_KEYS)


def _report(problems: list[str]) -> str:
    return f"{len(problems)} help string(s) to fix:\n" + "\n".join(problems)


def _history_marks(text: str) -> list[str]:
    return [f"{what} {match.group()!r}" for what, pattern in HISTORY_PATTERNS.items()
            for match in pattern.finditer(text)]


def test_the_walk_reaches_nested_listed_and_optional_sections():
    paths = {(key.root.__name__, key.path) for key in ALL_KEYS}
    assert len(KEYS) > 300
    for expected in [("JobConfig", "algo.kl_coef"), ("JobConfig", "placement.forecast.calibrate_window"),
                     ("JobConfig", "reward.rules.<i>.fn"), ("SftConfig", "steps"), ("RewardTrainConfig", "chosen_field"),
                     ("FlowGrpoJobConfig", "train.clip_range"), ("FlowSftConfig", "max_steps"),
                     ("Scenario", "workload.images.decode_seconds_per_image"), ("Scenario", "costs.engine_wake_s")]:
        assert expected in paths, expected


def test_every_key_has_help():
    problems = [f"{key.name}: no help string" for key in KEYS if not key.help]
    assert not problems, _report(problems)


def test_help_is_short():
    problems = [f"{key.name}: {len(key.help)} characters, over {MAX_HELP_CHARS}; keep what the key does, "
                f"its unit and range, and move the rest to the docs" for key in KEYS if len(key.help) > MAX_HELP_CHARS]
    assert not problems, _report(problems)


def test_help_holds_no_history():
    problems = [f"{key.name}: holds {', '.join(marks)}; dates, commits and sessions belong in the docs"
                for key in KEYS if (marks := _history_marks(key.help))]
    assert not problems, _report(problems)


@pytest.mark.parametrize("text,what", [
    ("Measured 2026-11-24 on a 2-vCPU VM.", "an ISO date"),
    ("as of Nov 2026", "a month-year date"),
    ("fitted in November 24, 2026", "a month-year date"),
    ("since 11/2026", "a month-year date"),
    ("see 44a7871 for the fix", "a commit-hash-like token"),
    ("(commit 2364b82c9e1f0a7d)", "a commit-hash-like token"),
    ("re-run in session 12", "a session number"),
    ("Session #3 found it", "a session number"),
])
def test_the_history_patterns_catch(text, what):
    assert any(mark.startswith(what) for mark in _history_marks(text)), (text, _history_marks(text))


@pytest.mark.parametrize("text", [
    "Largest resized image in pixels (Qwen2-VL's preprocessor_config: 12845056).",
    "Learning rate, e.g. 1e-5 or 3e-4; 6.0e6 FLOPs per pixel.",
    "A colour such as #a1b2c3d or a literal 0x1f2e3d4 is not a commit.",
    "Words made of hex letters: facade, deadbeef, accede, decaded.",
    "You may 2 or 3 times; the sampler may retry (Yao et al. 2025).",
    "Ranges such as 64-1024 px and 1/2 of the devices; 2-vCPU machines; H100, A100.",
    "Sessions of the engine (max 4) and a session id string.",
    "sha256 digests and bf16 weights; fp8 e4m3 kernels.",
])
def test_the_history_patterns_pass_reference_text(text):
    assert _history_marks(text) == []
