"""Loading prompt rows from a built-in task, a JSONL / Parquet file or a `datasets` folder, one shard at a time.

Every returned row is a plain dict with a ``"prompt"`` string, an ``"answer"`` string when an
answer column is configured, and every other column of the source unchanged. A chat-format source
(one with the `DataConfig.messages_field` column) gives rows with ``"messages"`` (a validated
conversation) in place of ``"prompt"``, rendered later with the tokenizer (`gcore_rl.data.chat`). Rewards receive the
whole row (minus the prompt) as keyword arguments, so no bookkeeping keys are added to rows.
A row with images holds ``"images"``: its decoded RGB `PIL.Image`s, one per placeholder of its prompt
(read from the `DataConfig.images_field` column of a file, or drawn for a visual task; see
`gcore_rl.data.images`). Images are decoded, or drawn, for a shard's own rows only.

Data parallelism uses a fixed partition (`shard_row_indices`): shard ``i`` of ``K`` owns the
global rows ``i, i + K, i + 2K, ...`` of the source, in every epoch. `load_prompt_rows` returns
only the rows of one shard, so a controller's memory for prompt rows (and image payloads) falls
with the number of controllers; the order inside a shard is chosen by `ShardedPromptSampler`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gcore_rl.agents.environments import environment_factory, spec_name
from gcore_rl.data.chat import image_parts, messages_problem
from gcore_rl.data.config import SUPPORTED_SUFFIXES, DataConfig
from gcore_rl.data.images import (
    decode_images,
    first_count_mismatch,
    image_count,
    image_counts,
    placeholder_problem,
)
from gcore_rl.data.indexed import indexed_task_rows, is_indexed_task
from gcore_rl.data.tasks import attach_task_images, make_task_rows
from gcore_rl.errors import ConfigError, DataError
from gcore_rl.models.vision import IMAGE_PLACEHOLDER

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

EVAL_SEED_OFFSET = 1_000_003
"""Added to `DataConfig.seed` to generate the held-out evaluation rows of a synthetic task."""

_GATHER_BATCH_ROWS = 4096
"""Rows of a prompt file converted to Python dicts per gather (bounds the transient Arrow memory)."""


def shard_row_indices(num_rows: int, shard_index: int, num_shards: int) -> range:
    """Global row indices owned by shard `shard_index` of `num_shards`: ``range(shard_index, num_rows, num_shards)``.

    The shards are disjoint, together cover ``range(num_rows)``, and differ in size by at most one
    row. Raises ValueError unless ``0 <= shard_index < num_shards``, and `DataError` when
    ``num_rows < num_shards`` (some shard would get no rows; raised on every shard alike).
    """
    _check_shard_arguments(shard_index, num_shards)
    if num_rows < num_shards:
        raise DataError(
            f"{num_rows} prompt rows cannot be split over {num_shards} shards: every shard needs at least one row; "
            "use more prompts or fewer data-parallel controllers"
        )
    return range(shard_index, num_rows, num_shards)


def _check_shard_arguments(shard_index: int, num_shards: int) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards - 1}], got {shard_index}")


def load_prompt_rows(cfg: DataConfig, shard_index: int = 0, num_shards: int = 1, *,
                     require_prompt: bool = True) -> list[dict[str, Any]]:
    """Return the training prompt rows of shard `shard_index` of `num_shards` (see `shard_row_indices`).

    The rows come in source order and equal ``rows[shard_index::num_shards]`` of the unsharded
    result (the sampler shuffles). Synthetic tasks generate the small text rows of all
    `cfg.num_prompts` rows with `cfg.seed`, keep the owned ones, and draw a visual task's images
    (`gcore_rl.data.tasks.attach_task_images`) and create the optional image payload (see
    `attach_image_payload`) for owned rows only. Files are read with
    ``datasets.load_dataset("json" | "parquet", ...)`` from the local path only, memory-mapped
    from an Arrow cache (see `_arrow_cache_dir`); a folder is opened with ``datasets.load_from_disk``
    (memory-mapped as saved; its ``train`` split for a DatasetDict). Only the owned rows are
    converted to dicts. A source with the `cfg.messages_field` column is chat-format: its rows hold
    ``"messages"`` instead of ``"prompt"``, every conversation of the source is checked
    (`gcore_rl.data.chat.messages_problem`), and an answer column is optional. With
    `require_prompt` False a source with neither a prompt nor a messages column gives its rows as
    they are (preference rows whose chosen/rejected are whole conversations).
    The prompt comes from `cfg.prompt_field`; when `cfg.answer_field` is set its value is stored
    under ``"answer"`` (numbers are converted to strings). The `cfg.images_field` column becomes
    ``"images"``, the owned rows' images decoded (`gcore_rl.data.images.decode_images`; a row with
    none has no ``"images"``). The renamed source columns are not duplicated; all other columns are
    kept as they are.

    Raises ValueError for bad shard arguments, and `DataError` for a missing or unreadable file, an
    empty dataset, a missing prompt or answer column, a row whose prompt is absent or not a string
    or whose answer is absent or not a string/number, or whose image count differs from its
    placeholders (naming file, global row and field; the whole file is checked, so every shard
    reports the same first bad row), or fewer rows than shards; and for an owned row's image that is
    missing, undecodable or over `cfg.max_image_pixels` (checked by the shard that owns the row).
    """
    _check_shard_arguments(shard_index, num_shards)
    if is_indexed_task(cfg.task):  # a shard builds only its own rows: item i depends on the seed and i alone
        owned = shard_row_indices(cfg.num_prompts, shard_index, num_shards)
        return indexed_task_rows(cfg.task, cfg.num_prompts, cfg.seed, cfg.task_options, indices=owned)
    if cfg.task is not None:
        rows = make_task_rows(cfg.task, cfg.num_prompts, cfg.seed, **cfg.task_options)
        owned = shard_row_indices(len(rows), shard_index, num_shards)
        owned_rows = attach_task_images([rows[i] for i in owned])
        return attach_image_payload(owned_rows, owned, cfg.payload_image_size, cfg.seed)
    if cfg.path is None:
        raise DataError("no prompt source: set `data.task` or `data.path`")
    return _load_file_rows(cfg, shard_index, num_shards, require_prompt)


def attach_image_payload(
    rows: list[dict[str, Any]], row_indices: Sequence[int], size: int, seed: int
) -> list[dict[str, Any]]:
    """Give each row a random uint8 `image` of shape ``[3, size, size]`` (returns `rows` as is for size 0).

    `row_indices[j]` is the global index of `rows[j]` (same length as `rows`); the image of global
    row ``g`` is drawn from ``np.random.default_rng([seed, g])``, so it depends only on the seed
    and the row, never on how the rows are sharded. `seed` must be non-negative.
    """
    if len(row_indices) != len(rows):
        raise ValueError(f"got {len(rows)} rows but {len(row_indices)} row indices")
    if size <= 0:
        return rows
    return [{**row, "image": _row_image(seed, index, size)} for row, index in zip(rows, row_indices, strict=True)]


def _row_image(seed: int, row_index: int, size: int) -> np.ndarray:
    rng = np.random.default_rng([seed, row_index])
    return rng.integers(0, 256, size=(3, size, size), dtype=np.uint8)


def load_eval_rows(cfg: DataConfig, shard_index: int = 0, num_shards: int = 1) -> list[dict[str, Any]]:
    """Return the held-out rows for accuracy evaluation of shard `shard_index` of `num_shards`:
    ``rows[shard_index::num_shards]`` (empty for a shard beyond the last row).

    For a synthetic task these are `cfg.eval_prompts` fresh rows generated with seed
    ``cfg.seed + 1_000_003`` (same task options as training), a visual task's images drawn for the
    shard's rows only. A file source has no built-in held-out split, so this returns an empty list
    and no evaluation is run.
    """
    _check_shard_arguments(shard_index, num_shards)
    if cfg.task is None or cfg.eval_prompts <= 0:
        return []
    if is_indexed_task(cfg.task):
        return indexed_task_rows(cfg.task, cfg.eval_prompts, cfg.seed + EVAL_SEED_OFFSET, cfg.task_options,
                             indices=range(shard_index, cfg.eval_prompts, num_shards))
    rows = make_task_rows(cfg.task, cfg.eval_prompts, cfg.seed + EVAL_SEED_OFFSET, **cfg.task_options)
    return attach_task_images(rows[shard_index::num_shards])


def _arrow_cache_dir() -> Path:
    """Directory of the Arrow cache that prompt files are converted into: ``<tempdir>/gcore_rl-datasets-<uid>``.

    Why there: it needs no network and no configuration, keeps the user's home (and the default
    Hugging Face cache) clean, and, unlike the dataset file's own directory, is writable even when
    the data lives on a read-only mount. It is one directory per user and host, so all
    controllers of a host share one converted copy: `datasets` fingerprints the file (path and
    mtime, so an edited file is converted again) and serialises the conversion with file locks
    next to the cache, so concurrent loads of the same file are safe — one process converts, the
    others wait and memory-map the result. The per-user name avoids permission clashes between
    users on a shared host (the directory is created private, mode 0700). Stale caches are left
    for the system's temp cleaning.
    """
    owner = os.getuid() if hasattr(os, "getuid") else "user"
    path = Path(tempfile.gettempdir()) / f"gcore_rl-datasets-{owner}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _open_table(path: Path) -> datasets.Dataset:
    """Open a JSONL/JSON or Parquet file as a memory-mapped `datasets.Dataset` (local only, no row copied)."""
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
        return datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=False,
                                     cache_dir=str(_arrow_cache_dir()))
    except Exception as exc:  # datasets/pyarrow raise many different types for malformed files
        bad_line = _first_bad_json_line(path) if path.suffix.lower() == ".jsonl" else None
        if bad_line is not None:
            raise DataError(f"prompt file {path}, {bad_line}") from exc
        detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if exc.__cause__ is not None:
            detail += f" ({type(exc.__cause__).__name__}: {exc.__cause__})"
        raise DataError(f"could not read prompt file {path}: {detail}") from exc
    finally:
        datasets.logging.set_verbosity(previous_level)
        if not bars_were_disabled:
            datasets.utils.enable_progress_bars()


def _first_bad_json_line(path: Path) -> str | None:
    """Where and why the first line of a JSON-lines file is not one UTF-8 JSON object, or None if every line is.

    The readers report a position inside their current block (or fail only once the text is
    converted), so the file is scanned again line by line to name the line as an editor numbers it.
    """
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                return (f"line {number}: byte {exc.start} of the line ({raw[exc.start:exc.start + 1]!r}) is not "
                        "UTF-8; re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove that line")
            except json.JSONDecodeError as exc:
                return f"line {number}: not valid JSON ({exc.msg} at column {exc.colno}); fix or remove that line"
            if not isinstance(value, dict):
                return f"line {number}: a JSON {type(value).__name__}, not an object of columns; fix or remove that line"
    return None


def _check_text_encoding(dataset: datasets.Dataset, path: Path) -> None:
    """Raise `DataError` naming the first row with text that is not valid UTF-8.

    The JSON reader stores undecodable bytes as they are and Parquet files may hold them too; they
    would fail later, when a controller converts its rows, without naming the file. Arrow's full
    validation checks the memory-mapped columns without converting them; only a failing chunk is
    bisected to find the row.
    """
    import pyarrow as pa

    for name in dataset.column_names:
        offset = 0
        for chunk in dataset.data.column(name).chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid:
                bad_line = _first_bad_json_line(path) if path.suffix.lower() == ".jsonl" else None
                where = bad_line or (f"row {offset + _first_invalid_row(chunk)}, column `{name}`: text that is not "
                                     "UTF-8; re-encode the text as UTF-8 or remove that row")
                raise DataError(f"prompt file {path}, {where}") from None
            offset += len(chunk)


def _first_invalid_row(chunk: pa.Array) -> int:
    """Index of the first element of `chunk` that fails Arrow's full validation (the whole chunk fails)."""
    import pyarrow as pa

    good, bad = 0, len(chunk)  # chunk[:good] is valid, chunk[:bad] is not
    while bad - good > 1:
        middle = (good + bad) // 2
        try:
            chunk.slice(0, middle).validate(full=True)
            good = middle
        except pa.ArrowInvalid:
            bad = middle
    return good


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


def _load_file_rows(cfg: DataConfig, shard_index: int, num_shards: int, require_prompt: bool) -> list[dict[str, Any]]:
    """Validate the whole source (cheaply, on Arrow columns) and convert the rows of one shard."""
    path = Path(str(cfg.path)).expanduser()
    if path.is_dir():
        dataset = _open_saved_dataset(path)
    elif path.is_file():
        dataset = _open_table(path)
    else:
        raise DataError(f"prompt file {path} does not exist")
    if len(dataset) == 0:
        raise DataError(f"prompt file {path} contains no rows")
    chat = cfg.messages_field in dataset.column_names
    prompt_field = None if chat or (not require_prompt and cfg.prompt_field not in dataset.column_names) else cfg.prompt_field
    answer_field = cfg.answer_field
    if answer_field is not None and answer_field not in dataset.column_names:
        if chat or prompt_field is None:
            answer_field = None  # a conversation's final assistant turn can be the answer (gcore_rl.data.chat)
        else:
            columns = ", ".join(sorted(dataset.column_names))
            raise DataError(
                f"prompt file {path} has no answer column `{answer_field}` (columns: {columns}); "
                "set `data.answer_field` to the right column, or to null if the file has no answers"
            )
    images_field = cfg.images_field if cfg.images_field in dataset.column_names else None
    _check_text_encoding(dataset, path)
    _check_field_values(dataset, path, prompt_field, answer_field)
    if chat:
        _check_conversations(dataset, path, cfg.messages_field, images_field)
    elif prompt_field is not None and images_field is not None:
        _check_placeholders(dataset, path, prompt_field, images_field)
    if "env" in dataset.column_names:
        _check_environments(dataset["env"], path)
    owned = shard_row_indices(len(dataset), shard_index, num_shards)
    text_field, text_key = (cfg.messages_field, "messages") if chat else (prompt_field, "prompt")
    base_dir = path if path.is_dir() else path.parent
    rows = []
    for number, raw in zip(owned, _select_rows(dataset, owned), strict=True):
        row = _prompt_row(raw, text_field, answer_field, text_key)
        if chat:  # a source's own prompt column beside the conversation would hide that the row needs rendering
            row.pop("prompt", None)
        images = row.pop(images_field, None) if images_field is not None else None
        if image_count(images):  # decoded here, for the shard's own rows only
            row["images"] = decode_images(images, base_dir, f"prompt file {path}, row {number}", cfg.max_image_pixels)
        rows.append(row)
    return rows


def _open_saved_dataset(path: Path) -> datasets.Dataset:
    """A folder written by ``save_to_disk``, memory-mapped (a DatasetDict's ``train`` split)."""
    import datasets  # deferred, as in `_open_table`

    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=False)
    except Exception as exc:  # FileNotFoundError for a folder without dataset_info.json/state.json, and others
        raise DataError(f"could not read prompt folder {path} as a dataset saved with datasets' save_to_disk "
                        f"({type(exc).__name__}: {exc})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"prompt folder {path} holds the splits {', '.join(sorted(loaded))} but no `train`; "
                            "point data.path at one split's folder")
        loaded = loaded["train"]
    return loaded


def _check_conversations(dataset: datasets.Dataset, path: Path, messages_field: str, images_field: str | None) -> None:
    """DataError naming the first row (of the whole source) whose conversation is not valid, or whose
    image parts and images (in `images_field`, counted without reading them) do not pair up."""
    counts = image_counts(dataset.data.column(images_field)).to_pylist() if images_field is not None else None
    offset = 0
    for batch in dataset.select_columns([messages_field]).iter(batch_size=_GATHER_BATCH_ROWS):
        for number, messages in enumerate(batch[messages_field], start=offset):
            problem = messages_problem(messages)
            if problem is None:
                problem = placeholder_problem(image_parts(messages), counts[number] if counts is not None else 0,
                                              "image parts in its `messages`")
            if problem is not None:
                raise DataError(f"prompt file {path}, row {number}: {problem}")
        offset += len(batch[messages_field])


def _check_placeholders(dataset: datasets.Dataset, path: Path, prompt_field: str, images_field: str) -> None:
    """DataError naming the first row (of the whole source) whose prompt's placeholders and images
    differ in number; counted on the Arrow columns, no image read."""
    import pyarrow.compute as pc

    prompts, images_column = dataset.data.column(prompt_field), dataset.data.column(images_field)
    row = first_count_mismatch(pc.count_substring(prompts, IMAGE_PLACEHOLDER), images_column)
    if row is not None:
        placeholders = prompts[row].as_py().count(IMAGE_PLACEHOLDER)
        images = image_counts(images_column)[row].as_py()
        raise DataError(f"prompt file {path}, row {row}: {placeholder_problem(placeholders, images)} "
                        f"(column `{images_field}`)")


def _select_rows(dataset: datasets.Dataset, indices: range) -> Iterator[dict[str, Any]]:
    """The rows at `indices` as dicts, gathered `_GATHER_BATCH_ROWS` at a time.

    Gathering in bounded batches keeps the transient Arrow copy small (one batch, not the whole
    shard: the allocator keeps freed Arrow memory, so a shard-sized gather would stay resident).
    ``keep_in_memory=True`` keeps each small index mapping in memory, so nothing is written to the cache.
    """
    for start in range(0, len(indices), _GATHER_BATCH_ROWS):
        yield from dataset.select(indices[start : start + _GATHER_BATCH_ROWS], keep_in_memory=True).to_list()


def _prompt_row(raw: dict[str, Any], text_field: str | None, answer_field: str | None,
                text_key: str = "prompt") -> dict[str, Any]:
    """One validated source row as a prompt row (renamed columns dropped, `text_field` as `text_key`, answer as text)."""
    row = {k: v for k, v in raw.items() if k not in (text_field, answer_field)}
    if text_field is not None:
        row[text_key] = raw[text_field]
    if answer_field is not None:
        row["answer"] = _answer_text(raw[answer_field])
    return row


def _answer_text(value: str | int | float) -> str:
    """A valid answer as text: strings unchanged, integral finite floats without ``.0``."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value)


def _prompt_problem(value: Any) -> str | None:
    """What is wrong with a prompt value, or None when it is a string."""
    if isinstance(value, str):
        return None
    return "is missing" if value is None else f"is not a string (got {type(value).__name__})"


def _answer_problem(value: Any) -> str | None:
    """What is wrong with an answer value, or None when it is a string or a (non-bool) number."""
    if isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return None
    return "is missing" if value is None else f"is not a string or number (got {type(value).__name__})"


def _is_text_type(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or is_view(arrow_type)


def _is_answer_type(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    return _is_text_type(arrow_type) or pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)


def _check_environments(specs: Sequence[Any], path: Path) -> None:
    """Raise `DataError` for the first row whose `env` column names an environment (a `name`) that cannot be made:
    an unknown textarena game, an import path that does not import, options the environment refuses. Each
    distinct spec is resolved once (a `textarena:` game is built and reset). A spec without a name is an agent's
    episode data (`agent_loop`), not checked here."""
    seen: set[str] = set()
    for row, spec in enumerate(specs):
        if not isinstance(spec, dict) or "name" not in spec:
            continue
        key = json.dumps({"name": spec.get("name"), "options": spec.get("options")}, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        try:
            name, options = spec_name(spec, "env")
            environment_factory(name, options, "env.name")
        except ConfigError as exc:
            raise DataError(f"prompt file {path}, row {row}: its `env` column names no environment that can be "
                            f"made ({exc})") from None


def _check_field_values(dataset: datasets.Dataset, path: Path, prompt_field: str | None, answer_field: str | None) -> None:
    """Raise `DataError` for the first row of the file (global index) with a bad prompt or answer.

    Works on the memory-mapped Arrow columns without converting rows: a column of a valid type
    can only be bad where it is null, and a column of any other type (or an absent column) is bad
    from row 0 on. On a tie the prompt is reported, as a row-by-row check would.
    """
    checks: list[tuple[str, str, Callable[[pa.DataType], bool], Callable[[Any], str | None]]] = []
    if prompt_field is not None:
        checks.append(("prompt", prompt_field, _is_text_type, _prompt_problem))
    if answer_field is not None:
        checks.append(("answer", answer_field, _is_answer_type, _answer_problem))
    found = []
    for kind, field_name, valid_type, problem in checks:
        row = _first_bad_row(dataset, field_name, valid_type)
        if row is not None:
            found.append((row, kind, field_name, problem))
    if not found:
        return
    row, kind, field_name, problem = min(found, key=lambda item: item[0])
    value = dataset.data.column(field_name)[row].as_py() if field_name in dataset.column_names else None
    raise DataError(f"prompt file {path}, row {row}: {kind} field `{field_name}` {problem(value)}")


def _first_bad_row(dataset: datasets.Dataset, field_name: str, valid_type: Callable[[pa.DataType], bool]) -> int | None:
    """Index of the first row whose `field_name` is absent, null or of an invalid type; None if all are valid."""
    if field_name not in dataset.column_names:
        return 0
    column = dataset.data.column(field_name)
    if not valid_type(column.type):
        return 0
    if column.null_count == 0:
        return None
    import pyarrow.compute as pc

    return int(pc.index(column.is_null(), True).as_py())
