"""Loading prompt rows from a built-in task or from a JSONL / Parquet file.

Every returned row is a plain dict with a ``"prompt"`` string, an ``"answer"`` string when an
answer column is configured, and every other column of the source unchanged. Rewards receive the
whole row (minus the prompt) as keyword arguments.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from gcore_rl.data.config import SUPPORTED_SUFFIXES, DataConfig
from gcore_rl.data.tasks import make_task_rows
from gcore_rl.errors import DataError

EVAL_SEED_OFFSET = 1_000_003
"""Added to `DataConfig.seed` to generate the held-out evaluation rows of a synthetic task."""


def load_prompt_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    """Return the training prompt rows described by `cfg` (in source order; the sampler shuffles).

    Synthetic tasks generate `cfg.num_prompts` rows with `cfg.seed`. Files are read with
    `datasets.load_dataset("json" | "parquet", ...)` from the local path only. The prompt comes
    from `cfg.prompt_field`; when `cfg.answer_field` is set its value is stored under ``"answer"``
    (numbers are converted to strings). The renamed source columns are not duplicated; all other
    columns are kept as they are.

    Raises `DataError` for a missing or unreadable file, an empty dataset, a missing prompt or
    answer column, or a row whose prompt is absent or not a string (naming file, row and field).
    """
    if cfg.task is not None:
        rows = make_task_rows(cfg.task, cfg.num_prompts, cfg.seed, **cfg.task_options)
        return attach_image_payload(rows, cfg.payload_image_size, cfg.seed)
    if cfg.path is None:
        raise DataError("no prompt source: set `data.task` or `data.path`")
    return _load_file_rows(cfg.path, cfg.prompt_field, cfg.answer_field)


def attach_image_payload(rows: list[dict[str, Any]], size: int, seed: int) -> list[dict[str, Any]]:
    """Give every row a random `image` array of shape `[3, size, size]`, uint8 (no-op for size 0)."""
    if size <= 0:
        return rows
    rng = np.random.default_rng(seed)
    return [{**row, "image": rng.integers(0, 256, size=(3, size, size), dtype=np.uint8)} for row in rows]


def load_eval_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    """Return held-out rows for accuracy evaluation.

    For a synthetic task these are `cfg.eval_prompts` fresh rows generated with seed
    ``cfg.seed + 1_000_003`` (same task options as training). A file source has no built-in
    held-out split, so this returns an empty list and no evaluation is run.
    """
    if cfg.task is None or cfg.eval_prompts <= 0:
        return []
    return make_task_rows(cfg.task, cfg.eval_prompts, cfg.seed + EVAL_SEED_OFFSET, **cfg.task_options)


def _read_table(path: Path) -> list[dict[str, Any]]:
    """Read a JSONL/JSON or Parquet file into a list of dict rows with `datasets` (local only)."""
    builder = SUPPORTED_SUFFIXES.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"unsupported prompt file type `{path.suffix or '(none)'}` for {path}; "
                        f"use one of {', '.join(SUPPORTED_SUFFIXES)}")
    if _is_empty(path, builder):
        raise DataError(f"prompt file {path} contains no rows")
    import datasets  # deferred: importing `datasets` is slow and only needed for file sources

    previous_level = datasets.logging.get_verbosity()
    bars_were_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(logging.CRITICAL)  # failures are re-raised as DataError
    datasets.utils.disable_progress_bars()
    try:
        dataset = datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True)
    except Exception as exc:  # datasets/pyarrow raise many different types for malformed files
        detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if exc.__cause__ is not None:
            detail += f" ({type(exc.__cause__).__name__}: {exc.__cause__})"
        raise DataError(f"could not read prompt file {path}: {detail}") from exc
    finally:
        datasets.logging.set_verbosity(previous_level)
        if not bars_were_disabled:
            datasets.utils.enable_progress_bars()
    return dataset.to_list()


def _is_empty(path: Path, builder: str) -> bool:
    """True for a file without rows (`datasets` fails on these with unhelpful errors)."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_metadata(path).num_rows == 0
        except Exception as exc:
            raise DataError(f"could not read prompt file {path}: not a valid Parquet file ({exc})") from exc
    with path.open("rb") as handle:
        head = handle.read(4096).strip()
        if head in (b"", b"[]"):
            return handle.read(1) == b""
    return False


def _load_file_rows(path_str: str, prompt_field: str, answer_field: str | None) -> list[dict[str, Any]]:
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist or is not a file")
    raw_rows = _read_table(path)
    if not raw_rows:
        raise DataError(f"prompt file {path} contains no rows")
    columns = set(raw_rows[0])
    if answer_field is not None and answer_field not in columns:
        raise DataError(
            f"prompt file {path} has no answer column `{answer_field}` (columns: {', '.join(sorted(columns))}); "
            "set `data.answer_field` to the right column, or to null if the file has no answers"
        )
    rows = []
    for index, raw in enumerate(raw_rows):
        prompt = raw.get(prompt_field)
        if not isinstance(prompt, str):
            problem = "is missing" if prompt is None else f"is not a string (got {type(prompt).__name__})"
            raise DataError(f"prompt file {path}, row {index}: prompt field `{prompt_field}` {problem}")
        row = {k: v for k, v in raw.items() if k not in (prompt_field, answer_field)}
        row["prompt"] = prompt
        if answer_field is not None:
            row["answer"] = _answer_text(raw.get(answer_field), path, index, answer_field)
        rows.append(row)
    return rows


def _answer_text(value: Any, path: Path, index: int, field_name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None or not isinstance(value, (int, float)):
        kind = "is missing" if value is None else f"is not a string or number (got {type(value).__name__})"
        raise DataError(f"prompt file {path}, row {index}: answer field `{field_name}` {kind}")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value)
