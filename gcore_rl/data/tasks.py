"""Built-in synthetic tasks whose answers can be checked exactly.

Every task produces plain dict rows ``{"prompt": str, "answer": str, "task": str}``. Generation is
driven by a private `random.Random(seed)`, so the same (task, num_rows, seed, options) always gives
the same rows, independent of any global random state.

Available tasks and their options:

``addition``
    Prompt ``"37+58="``, answer ``"95"``. Each operand is drawn uniformly from
    ``[0, 10**digits - 1]`` (so it may have fewer than `digits` digits; no leading zeros).
    Options: ``digits`` (int >= 1, default 2), ``reverse`` (0 or 1, default 0): with 1 every sum is
    written least-significant digit first (``"37+58="`` → ``"59"``), the order in which a person
    adds and carries. A small model learns that order from a few hundred examples, where the usual
    order needs the carry before the first digit is written and takes many times longer (Lee et al.
    2023, "Teaching Arithmetic to Small Transformers", arXiv 2307.03381); the demo uses it so
    that its 0.8M-parameter model learns within minutes on a CPU.

``reversal``
    Prompt ``"abcd>"``, answer ``"dcba"``. The string length is uniform in
    ``[min_len, max_len]`` and each letter is uniform over the first ``alphabet_size`` letters of
    ``a..j``. Options: ``min_len`` (int >= 1, default 3), ``max_len`` (int >= min_len, default 5),
    ``alphabet_size`` (int in 1..10, default 10).

``judge_addition``
    Rows that teach a tiny judge model to grade addition answers. The prompt is the default
    `JudgeConfig` template rendered with an addition question (operands as in ``addition``) and a
    candidate answer, e.g. ``"Q:37+58= A:96 score:"``. The answer starts with the verdict score
    that follows ``score:``: ``"10"`` when the candidate is the correct sum; for a wrong candidate
    ``"0"`` followed by a correction, a space, ``=`` and the correct sum (``"0 =95"`` here).
    `parse_verdict` reads only the first number after ``score:``, so the correction never changes
    the verdict; it is there to be learned: writing the correct sum after a wrong answer makes the
    tiny judge compute the sum instead of copying the candidate, which is what it needs to tell
    near misses from correct answers (trained on the bare verdicts it only learns to reject empty
    or truncated answers). Half of the candidates are correct. A wrong candidate is one of six
    kinds (column ``mistake``), drawn with weights 2:2:2:1:1:1: ``small`` (the sum ±1..3),
    ``tens`` (the sum ±10), ``digit`` (one digit of the sum replaced by another, no leading zero),
    ``drop`` (one digit of the sum removed), ``empty`` (``""``) and ``random`` (a uniform other
    number in [0, 2 * (10**digits - 1)]). Offsets that would go below 0 are not used; ``drop``
    of a one-digit sum falls back to ``small``. With ``reverse=1`` candidates and corrections are
    written least-significant digit first, as the ``addition`` task's answers. The first three are the near misses an addition
    policy makes (two thirds of the wrong candidates); the last three are easy. Options:
    ``digits`` (int >= 1, default 2), ``reverse`` (as for ``addition``). Extra columns: ``question``, ``candidate``, ``correct``
    (bool), ``verdict`` (``"10"`` or ``"0"``), ``total`` (the correct sum as a string) and
    ``mistake`` (``None`` for a correct candidate).

``addition_preferences``
    Preference pairs for training a scalar reward model (``gcore-rl rm``). Prompt ``"37+58="`` as
    in ``addition``; ``chosen`` is the correct sum (``"95"``) and ``rejected`` a wrong answer of
    one of the kinds of ``judge_addition`` (column ``mistake``, same 2:2:2:1:1:1 weights, so two
    thirds are near misses). Every row has a pair; ``answer`` is the correct sum as well. Options:
    ``digits`` (int >= 1, default 2), ``reverse`` (as for ``addition``: every sum, chosen and
    rejected, written least-significant digit first). Extra columns: ``chosen``, ``rejected``, ``mistake``.

``addition_chat``
    The ``addition`` rows as conversations (chat format, `gcore_rl.data.chat`): ``messages`` =
    ``[{"role": "system", "content": "Add."}, {"role": "user", "content": "37+58="},
    {"role": "assistant", "content": "95"}]`` and no ``prompt``; ``answer`` is the sum as well, for
    rewards. SFT trains on the assistant turn; GRPO prompts with the turns before it. Options as for
    ``addition``, plus ``system`` (0 or 1, default 1): whether the system turn is there.
    ``gcore-rl write-task addition_chat FILE`` writes them as JSONL.

``multiply_tool``
    Multiplication a tiny model cannot do in its head, for tool-use demos: prompt ``"4821*7730="`` (chat
    rows), answer ``"37266330"``, both factors uniform over the ``digits``-digit numbers. A share ``calls``
    of the rows (drawn per row) are tool-use traces: the assistant calls ``mul`` in the Hermes format
    (``<tool_call>{"name":"mul","arguments":{"a":4821,"b":7730}}</tool_call>``), the tool answers, and the
    assistant repeats the answer; the other rows answer at once. For SFT (``train_turns: all``) use the
    share the warm start should call with; for GRPO ``calls: 0``, so the prompt is the question alone.
    Options: ``digits`` (int >= 1, default 4), ``calls`` (a share in [0, 1], default 0.25).

``shapes_vqa``
    Questions about an image (a vision-language task): prompt ``"<image>colour?"`` → ``"red"``, the
    colour of the shapes, or ``"<image>count?"`` → ``"2"``, how many there are. The image is
    `size` pixels square: 1-3 shapes (circles and squares, each in its own quadrant, never touching)
    of one colour (red, green, blue or yellow) on black, so both answers can be read off the image
    alone. Options: ``size`` (int in [8, 1024], default 32), ``questions`` (0: colour only, the
    default; 1: count only; 2: both, drawn half and half). Extra columns: ``question`` (``colour`` or
    ``count``), ``colour``, ``count``, and ``scene`` (the shapes, `gcore_rl.data.images.random_scene`),
    which `attach_task_images` replaces by the drawn ``images`` for the rows a controller owns (the
    pixels are made only there). Everything is drawn from a numpy generator seeded with `seed`, so
    rows and pixels are the same on every machine. ``gcore-rl write-task shapes_vqa FILE`` writes
    the images as PNG files in a folder beside the JSONL, named in the rows by relative path.

``shapes_preferences``
    Preference pairs about the ``shapes_vqa`` scenes (for ``gcore-rl rm`` with a vision-language
    model): the rows of ``shapes_vqa`` with the same seed and options (default ``questions`` 2: colour
    and count half and half), plus ``chosen`` (the right answer), ``rejected`` and ``mistake``, the kind
    of the rejected answer: ``wrong`` (7 rows in 10: another palette colour, or another count in 1-3),
    ``noisy`` (1 in 10: the right answer with 1-3 printable characters before or after it), ``junk``
    (1 in 10: 1-3 printable characters) or ``empty`` (1 in 10). The malformed kinds are what a policy
    sampling at a high temperature writes; a reward model that never saw them may score them high.

``judge_shapes``
    Judge prompts about the ``shapes_preferences`` pictures, for training a vision-language judge:
    ``"Q:<image>count? A:3 score:"`` (the default judge template around the question and a candidate)
    → ``"10"`` when the candidate is right, ``"0"`` when it is the row's rejected answer, half and
    half. Extra columns: ``verdict`` (as for ``judge_addition``: `verdict_match` grades a judge with
    it), ``candidate``, ``mistake`` (the rejected answer's kind, or null), and those of ``shapes_vqa``.

Options are integers only so that they fit `DataConfig.task_options` (``dict[str, int]``).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gcore_rl.data.images import SCENE_COLOURS, draw_scene, random_scene
from gcore_rl.data.indexed import indexed_task_rows, is_indexed_task
from gcore_rl.errors import DataError
from gcore_rl.models.vision import IMAGE_PLACEHOLDER
from gcore_rl.rewards.judge import JudgeConfig
from gcore_rl.rewards.judge_template import render_judge_prompt

_REVERSAL_LETTERS = "abcdefghij"

_JUDGE_TEMPLATE = JudgeConfig().template
_JUDGE_CHARACTERS = "".join(sorted(set(render_judge_prompt(_JUDGE_TEMPLATE, prompt="", completion=""))))

ADDITION_CHAT_SYSTEM = "Add."
"""System turn of `addition_chat_rows`."""

SHAPES_QUESTIONS = ("colour", "count")
"""The questions of `shapes_vqa_rows`; the prompt is the image placeholder, the question and ``?``."""

_JUNK_CHARACTERS = string.ascii_letters + string.digits + string.punctuation
"""What the malformed answers of `shapes_preference_rows` are made of."""

TASK_ALPHABET: str = ("0123456789+=>" + _REVERSAL_LETTERS + _JUDGE_CHARACTERS + ADDITION_CHAT_SYSTEM
                      + IMAGE_PLACEHOLDER + "".join(SHAPES_QUESTIONS) + "?" + "".join(SCENE_COLOURS) + _JUNK_CHARACTERS)
"""Every character that a built-in task prompt or answer can contain (all in the tiny tokenizer's vocabulary)."""

TaskGenerator = Callable[..., list[dict[str, Any]]]


def _int_option(task: str, name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataError(f"task `{task}`: option `{name}` must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise DataError(f"task `{task}`: option `{name}` must be {bounds}, got {value}")
    return value


def _draw_sum(rng: random.Random, digits: int) -> tuple[str, int]:
    """One addition question ``"a+b="`` and its sum, operands uniform in [0, 10**digits - 1]."""
    high = 10**digits - 1
    a, b = rng.randint(0, high), rng.randint(0, high)
    return f"{a}+{b}=", a + b


def _writer(task: str, reverse: int) -> Callable[[str], str]:
    """How `task` writes a number: as is, or least-significant digit first (option ``reverse``)."""
    if _int_option(task, "reverse", reverse, 0, 1):
        return lambda number: number[::-1]
    return lambda number: number


def addition_rows(num_rows: int, seed: int, digits: int = 2, reverse: int = 0) -> list[dict[str, Any]]:
    """`num_rows` sums ``"a+b="`` → ``str(a + b)`` (reversed with `reverse`=1), operands uniform in [0, 10**digits - 1]."""
    digits = _int_option("addition", "digits", digits, 1)
    write = _writer("addition", reverse)
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        question, total = _draw_sum(rng, digits)
        rows.append({"prompt": question, "answer": write(str(total)), "task": "addition"})
    return rows


def reversal_rows(
    num_rows: int, seed: int, min_len: int = 3, max_len: int = 5, alphabet_size: int = len(_REVERSAL_LETTERS)
) -> list[dict[str, Any]]:
    """`num_rows` strings ``"abcd>"`` → ``"dcba"``; length uniform in [min_len, max_len]."""
    min_len = _int_option("reversal", "min_len", min_len, 1)
    max_len = _int_option("reversal", "max_len", max_len, min_len)
    alphabet_size = _int_option("reversal", "alphabet_size", alphabet_size, 1, len(_REVERSAL_LETTERS))
    letters = _REVERSAL_LETTERS[:alphabet_size]
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        length = rng.randint(min_len, max_len)
        text = "".join(rng.choice(letters) for _ in range(length))
        rows.append({"prompt": f"{text}>", "answer": text[::-1], "task": "reversal"})
    return rows


JUDGE_CORRECT_SCORE = "10"
JUDGE_WRONG_SCORE = "0"
JUDGE_MISTAKES = ("small", "tens", "digit", "drop", "empty", "random")
"""Kinds of wrong candidates in `judge_addition` rows (see the module docstring)."""
_MISTAKE_DRAW = ("small", "small", "tens", "tens", "digit", "digit", "drop", "empty", "random")
_SMALL_OFFSETS = (-3, -2, -1, 1, 2, 3)
_TENS_OFFSETS = (-10, 10)


def _offset_sum(rng: random.Random, total: int, offsets: tuple[int, ...]) -> str:
    return str(total + rng.choice([d for d in offsets if total + d >= 0]))


def _wrong_sum(rng: random.Random, total: int, digits: int) -> tuple[str, str]:
    """(candidate, mistake kind): a wrong answer for the sum `total`, never equal to ``str(total)``."""
    correct = str(total)
    kind = rng.choice(_MISTAKE_DRAW)
    if kind == "empty":
        return "", kind
    if kind == "tens":
        return _offset_sum(rng, total, _TENS_OFFSETS), kind
    if kind == "digit":
        i = rng.randrange(len(correct))
        choices = [d for d in "0123456789" if d != correct[i] and not (i == 0 and d == "0" and len(correct) > 1)]
        return correct[:i] + rng.choice(choices) + correct[i + 1 :], kind
    if kind == "drop" and len(correct) >= 2:
        i = rng.randrange(len(correct))
        return correct[:i] + correct[i + 1 :], kind
    if kind == "random":
        other = rng.randrange(2 * (10**digits - 1))  # [0, 2*(10**digits - 1)] without `total`
        return str(other if other < total else other + 1), kind
    return _offset_sum(rng, total, _SMALL_OFFSETS), "small"


def judge_addition_rows(num_rows: int, seed: int, digits: int = 2, reverse: int = 0) -> list[dict[str, Any]]:
    """`num_rows` judge prompts grading a candidate sum, e.g. ``"Q:37+58= A:96 score:"``.

    The answer is ``"10"`` for a correct candidate and the verdict ``"0"`` plus the correct sum,
    ``"0 =95"``, for a wrong one; half of the candidates are correct, the others are wrong answers
    of the kinds in `JUDGE_MISTAKES` (see the module docstring). With `reverse`=1 every number after
    ``A:`` and ``=`` is written least-significant digit first.
    """
    digits = _int_option("judge_addition", "digits", digits, 1)
    write = _writer("judge_addition", reverse)
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        question, total = _draw_sum(rng, digits)
        correct = rng.random() < 0.5
        candidate, mistake = (str(total), None) if correct else _wrong_sum(rng, total, digits)
        verdict = JUDGE_CORRECT_SCORE if correct else JUDGE_WRONG_SCORE
        candidate, written_total = write(candidate), write(str(total))
        rows.append({
            "prompt": render_judge_prompt(_JUDGE_TEMPLATE, prompt=question, completion=candidate),
            "answer": verdict if correct else f"{verdict} ={written_total}",
            "task": "judge_addition",
            "question": question,
            "candidate": candidate,
            "correct": correct,
            "verdict": verdict,
            "total": written_total,
            "mistake": mistake,
        })
    return rows


def addition_preference_rows(num_rows: int, seed: int, digits: int = 2, reverse: int = 0) -> list[dict[str, Any]]:
    """`num_rows` preference pairs for an addition question ``"a+b="``: chosen = the sum, rejected = a wrong sum.

    The wrong answers are the kinds in `JUDGE_MISTAKES`, drawn as for `judge_addition_rows` (see
    the module docstring); ``mistake`` names the kind of each row's rejected answer.
    """
    digits = _int_option("addition_preferences", "digits", digits, 1)
    write = _writer("addition_preferences", reverse)
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        question, total = _draw_sum(rng, digits)
        rejected, mistake = _wrong_sum(rng, total, digits)
        rows.append({
            "prompt": question,
            "chosen": write(str(total)),
            "rejected": write(rejected),
            "answer": write(str(total)),
            "task": "addition_preferences",
            "mistake": mistake,
        })
    return rows


def addition_chat_rows(num_rows: int, seed: int, digits: int = 2, reverse: int = 0, system: int = 1) -> list[dict[str, Any]]:
    """`addition_rows` (same seed, same sums) as chat rows: system (optional), user question, assistant sum."""
    with_system = _int_option("addition_chat", "system", system, 0, 1)
    rows = []
    for row in addition_rows(num_rows, seed, digits, reverse):
        turns = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["answer"]}]
        if with_system:
            turns.insert(0, {"role": "system", "content": ADDITION_CHAT_SYSTEM})
        rows.append({"messages": turns, "answer": row["answer"], "task": "addition_chat"})
    return rows


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A Hermes tool call as a trained trace writes it: ``<tool_call>{json}</tool_call>``, JSON without spaces."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def multiply_tool_rows(num_rows: int, seed: int, digits: int = 4, calls: float = 0.25) -> list[dict[str, Any]]:
    """`num_rows` chat rows ``"a*b="`` → ``str(a * b)``, a share `calls` of them tool-use traces calling ``mul``."""
    digits = _int_option("multiply_tool", "digits", digits, 1)
    if not (isinstance(calls, (int, float)) and not isinstance(calls, bool) and 0.0 <= calls <= 1.0):
        raise DataError(f"task `multiply_tool`: option calls must be a share in [0, 1], got {calls!r}")
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(low, high), rng.randint(low, high)
        question, product = f"{a}*{b}=", str(a * b)
        via_tool = rng.random() < calls
        turns = ([{"role": "assistant", "content": tool_call_text("mul", {"a": a, "b": b})},
                  {"role": "tool", "content": product}] if via_tool else [])
        rows.append({"messages": [{"role": "user", "content": question}, *turns, {"role": "assistant", "content": product}],
                     "answer": product, "task": "multiply_tool", "via_tool": via_tool})
    return rows


def shapes_vqa_rows(num_rows: int, seed: int, size: int = 32, questions: int = 0) -> list[dict[str, Any]]:
    """`num_rows` questions about a scene of 1-3 same-coloured shapes: ``"<image>colour?"`` → ``"red"`` or
    ``"<image>count?"`` → ``"2"`` (`questions`: 0 colour, 1 count, 2 both). Rows hold the ``scene``,
    not its pixels (`attach_task_images` draws them)."""
    size = _int_option("shapes_vqa", "size", size, 8, 1024)
    questions = _int_option("shapes_vqa", "questions", questions, 0, 2)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_rows):
        question = SHAPES_QUESTIONS[int(rng.integers(2))] if questions == 2 else SHAPES_QUESTIONS[questions]
        colour, count = SCENE_COLOURS[int(rng.integers(len(SCENE_COLOURS)))], int(rng.integers(1, 4))
        rows.append({"prompt": f"{IMAGE_PLACEHOLDER}{question}?", "answer": colour if question == "colour" else str(count),
                     "task": "shapes_vqa", "question": question, "colour": colour, "count": count,
                     "scene": random_scene(rng, size, count)})
    return rows


SHAPES_MISTAKES = ("wrong", "noisy", "junk", "empty")
"""Kinds of rejected answers in `shapes_preference_rows` (see the module docstring)."""
_SHAPES_MISTAKE_DRAW = ("wrong",) * 7 + ("noisy", "junk", "empty")


def _wrong_shapes_answer(rng: np.random.Generator, row: dict[str, Any]) -> tuple[str, str]:
    """(rejected answer, mistake kind) for a `shapes_vqa` row: never its right answer."""
    answer = row["answer"]
    kind = _SHAPES_MISTAKE_DRAW[int(rng.integers(len(_SHAPES_MISTAKE_DRAW)))]
    if kind == "empty":
        return "", kind
    if kind == "wrong":
        options = SCENE_COLOURS if row["question"] == "colour" else tuple(str(n) for n in range(1, 4))
        wrong = [o for o in options if o != answer]
        return wrong[int(rng.integers(len(wrong)))], kind
    while True:
        noise = "".join(_JUNK_CHARACTERS[int(i)] for i in rng.integers(len(_JUNK_CHARACTERS), size=int(rng.integers(1, 4))))
        candidate = (noise + answer if rng.integers(2) else answer + noise) if kind == "noisy" else noise
        if candidate != answer:
            return candidate, kind


def shapes_preference_rows(num_rows: int, seed: int, size: int = 32, questions: int = 2) -> list[dict[str, Any]]:
    """`shapes_vqa_rows` (same seed, same scenes) as preference pairs: chosen = the right answer, rejected =
    a wrong one of a kind in `SHAPES_MISTAKES` (see the module docstring)."""
    rows = shapes_vqa_rows(num_rows, seed, size, questions)
    rng = np.random.default_rng([seed, 1])  # the rejected answers: a stream of their own
    for row in rows:
        rejected, kind = _wrong_shapes_answer(rng, row)
        row.update(chosen=row["answer"], rejected=rejected, mistake=kind, task="shapes_preferences")
    return rows


def judge_shapes_rows(num_rows: int, seed: int, size: int = 32, questions: int = 2) -> list[dict[str, Any]]:
    """`num_rows` judge prompts grading an answer about a `shapes_vqa` picture, ``"Q:<image>count? A:3 score:"``
    (the default judge template): the answer is ``"10"`` when the candidate is right, ``"0"`` when it is a
    rejected answer of `shapes_preference_rows` (same seed: same scenes and wrong answers), half and half."""
    rows = shapes_preference_rows(num_rows, seed, size, questions)
    rng = np.random.default_rng([seed, 2])
    for row in rows:
        correct = bool(rng.integers(2))
        chosen, rejected = row.pop("chosen"), row.pop("rejected")
        candidate = chosen if correct else rejected
        verdict = JUDGE_CORRECT_SCORE if correct else JUDGE_WRONG_SCORE
        row.update(prompt=render_judge_prompt(_JUDGE_TEMPLATE, prompt=row["prompt"], completion=candidate),
                   answer=verdict, verdict=verdict, candidate=candidate, task="judge_shapes",
                   mistake=None if correct else row["mistake"])
    return rows


def attach_task_images(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` with each ``scene`` of a visual task's row replaced by its drawn ``images`` (other rows as they are).

    Called for the rows a controller owns only, so the pixels of a shard are made by its controller.
    """
    return [row if "scene" not in row else
            {**{k: v for k, v in row.items() if k != "scene"}, "images": [draw_scene(row["scene"], row["colour"])]}
            for row in rows]


TASKS: dict[str, TaskGenerator] = {
    "addition": addition_rows,
    "addition_chat": addition_chat_rows,
    "reversal": reversal_rows,
    "judge_addition": judge_addition_rows,
    "addition_preferences": addition_preference_rows,
    "multiply_tool": multiply_tool_rows,
    "shapes_vqa": shapes_vqa_rows,
    "shapes_preferences": shapes_preference_rows,
    "judge_shapes": judge_shapes_rows,
}
"""Registry of built-in tasks: name → generator ``(num_rows, seed, **options) -> rows``."""

_TASK_OPTIONS: dict[str, tuple[str, ...]] = {
    "addition": ("digits", "reverse"),
    "addition_chat": ("digits", "reverse", "system"),
    "reversal": ("min_len", "max_len", "alphabet_size"),
    "judge_addition": ("digits", "reverse"),
    "addition_preferences": ("digits", "reverse"),
    "multiply_tool": ("digits", "calls"),
    "shapes_vqa": ("size", "questions"),
    "shapes_preferences": ("size", "questions"),
    "judge_shapes": ("size", "questions"),
}


def make_task_rows(name: str, num_rows: int, seed: int, **options: Any) -> list[dict[str, Any]]:
    """Generate `num_rows` rows of the built-in task `name`, deterministically for `seed`.

    Raises `DataError` for an unknown task (listing the available ones), an unknown option, or an
    option value out of range.
    """
    if is_indexed_task(name):
        return indexed_task_rows(name, num_rows, seed, options)
    if name not in TASKS:
        raise DataError(f"unknown task `{name}`; available tasks: {', '.join(sorted(TASKS))}")
    if num_rows < 0:
        raise DataError(f"task `{name}`: number of rows must be >= 0, got {num_rows}")
    allowed = _TASK_OPTIONS.get(name)
    if allowed is not None:
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise DataError(
                f"task `{name}`: unknown option(s) {', '.join(unknown)}; "
                f"supported: {', '.join(allowed) if allowed else '(none)'}"
            )
    return TASKS[name](num_rows, seed, **options)


def write_task_jsonl(name: str, path: str | Path, num_rows: int, seed: int = 0, **options: Any) -> Path:
    """Write `make_task_rows(name, num_rows, seed, **options)` to `path` as JSON lines (one row a line); returns the path.

    A visual task's images are written as PNG files to the folder `image_folder(path)` beside it, and
    each row names its image by its path relative to the JSONL's folder (``"images": ["out-images/00000.png"]``),
    as a prompt file's rows do (`gcore_rl.data.images`). Refuses (DataError) to overwrite an existing
    file or image folder, so a dataset in use is never replaced.
    """
    rows = make_task_rows(name, num_rows, seed, **options)
    out, folder = Path(path), image_folder(path)
    scenes = any("scene" in row for row in rows)
    for existing in (out, folder) if scenes else (out,):
        if existing.exists():
            raise DataError(f"'{existing}' already exists; choose a new file or remove the old one")
    out.parent.mkdir(parents=True, exist_ok=True)
    if scenes:
        folder.mkdir()
        rows = [_with_image_files(row, folder, index) for index, row in enumerate(attach_task_images(rows))]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return out


def image_folder(path: str | Path) -> Path:
    """Where `write_task_jsonl` puts the images of the JSONL file `path`: ``<folder>/<name>-images``."""
    out = Path(path)
    return out.with_name(f"{out.stem}-images")


def _with_image_files(row: dict[str, Any], folder: Path, index: int) -> dict[str, Any]:
    """`row` with its drawn images saved as ``<folder>/<index>[-<k>].png`` and named by relative path."""
    names = []
    for number, image in enumerate(row["images"]):
        name = f"{index:05d}.png" if number == 0 else f"{index:05d}-{number}.png"
        image.save(folder / name, format="PNG")
        names.append(f"{folder.name}/{name}")
    return {**row, "images": names}
