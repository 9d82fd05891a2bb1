"""A checkpoint's manifest: written when a save finishes, checked before anything is loaded.

`finalize` turns a fully written ``step-N.incomplete/`` folder into ``step-N/``: it records every
file's size and sha256 in ``manifest.json`` (atomically, fsynced) and only then renames the folder,
so a folder without the suffix is always whole as written. `verify` checks a folder against its
manifest (files present, sizes, checksums) and reads DCP's ``trainer/.metadata`` with an unpickler
that accepts only the classes DCP's metadata is made of. `list_checkpoints`, `newest_valid` and
`prune` work on a checkpoint root (or a run folder that has ``checkpoints/``).

Pure file logic: no process groups; every failure is a `CheckpointError` of one paragraph that
names the checkpoint folder, the file, and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gcore_rl.checkpoint import layout
from gcore_rl.checkpoint.unpickle import RefusedGlobal, unpickle_metadata
from gcore_rl.errors import CheckpointError

CHUNK_BYTES = 1 << 20
"""Files are hashed in chunks of this size, so a checkpoint of any size is hashed in constant memory."""
DCP_METADATA = f"{layout.TRAINER_DIR}/.metadata"
"""DCP's index of the trainer's tensors, relative to the checkpoint folder (the one pickle in a checkpoint,
with the critic's when it trained on devices of its own)."""
DCP_METADATA_FILES = tuple(f"{folder}/.metadata" for folder in layout.DCP_DIRS)


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the folder (POSIX), size and sha256."""

    path: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class FrozenModel:
    """A model the job reads but never trains (reference, judge, reward model), by path and weights checksum."""

    role: str
    path: str
    sha256: str


@dataclass
class Manifest:
    """What `manifest.json` records about a complete checkpoint (see `gcore_rl.checkpoint.layout`)."""

    format: int
    step: int
    created: str
    config_sha256: str
    controllers: int
    trainer_devices: int
    devices: int
    files: list[FileEntry] = field(default_factory=list)
    frozen: list[FrozenModel] = field(default_factory=list)
    save_seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        """Sum of the listed files' sizes (the manifest itself not included)."""
        return sum(entry.bytes for entry in self.files)

    def to_json(self) -> str:
        """The manifest as indented JSON text (what `manifest.json` holds)."""
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse `to_json`'s output; ValueError says what is wrong (not JSON, a field missing or mistyped)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("it is not a JSON object")
        if data.get("format") != layout.FORMAT_VERSION:
            raise ValueError(f"its format version is {data.get('format')!r}, and this gcore-rl reads version "
                             f"{layout.FORMAT_VERSION}")
        _check_fields(data, _MANIFEST_FIELDS)
        try:
            files = [FileEntry(**_checked(item, _FILE_FIELDS)) for item in data["files"]]
            frozen = [FrozenModel(**_checked(item, _FROZEN_FIELDS)) for item in data["frozen"]]
        except TypeError as exc:
            raise ValueError(str(exc)) from exc
        scalars = {key: data[key] for key in _MANIFEST_FIELDS if key not in ("files", "frozen")}
        return cls(**scalars, files=files, frozen=frozen, save_seconds=float(data.get("save_seconds", 0.0)))


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint folder as `list_checkpoints` sees it (world sizes and time are None without a manifest)."""

    step: int
    path: Path
    complete: bool
    created: str | None
    bytes: int
    controllers: int | None
    trainer_devices: int | None
    devices: int | None


_MANIFEST_FIELDS: dict[str, type] = {"format": int, "step": int, "created": str, "config_sha256": str,
                                     "controllers": int, "trainer_devices": int, "devices": int,
                                     "files": list, "frozen": list}
_FILE_FIELDS: dict[str, type] = {"path": str, "bytes": int, "sha256": str}
_FROZEN_FIELDS: dict[str, type] = {"role": str, "path": str, "sha256": str}


def _check_fields(data: dict, fields: dict[str, type]) -> None:
    """Raise ValueError naming the fields of `data` that are missing or not of their type."""
    missing = [key for key in fields if key not in data]
    if missing:
        raise ValueError(f"it lacks the field(s) {', '.join(missing)}")
    mistyped = [key for key, kind in fields.items()
                if not isinstance(data[key], kind) or (kind is int and isinstance(data[key], bool))]
    if mistyped:
        raise ValueError(f"the field(s) {', '.join(mistyped)} have the wrong type")


def _checked(item: Any, fields: dict[str, type]) -> dict:
    """`item` when it is a JSON object with exactly `fields` of their types, else ValueError."""
    if not isinstance(item, dict):
        raise ValueError(f"an entry is {type(item).__name__}, not an object")
    _check_fields(item, fields)
    return item


# ---- hashing -------------------------------------------------------------------------------------


def config_sha256(cfg: dict) -> str:
    """sha256 of `cfg` as canonical JSON (sorted keys, no whitespace), so equal configs hash equal."""
    canonical = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _update_from_file(digest: Any, path: Path) -> None:
    """Feed the file at `path` to `digest` in `CHUNK_BYTES` chunks."""
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)


def file_sha256(path: str | Path) -> str:
    """sha256 of one file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    _update_from_file(digest, Path(path))
    return digest.hexdigest()


def _weight_files(model_dir: Path) -> list[Path]:
    """The model's weight files in name order: ``*.safetensors``, or ``*.bin`` for a folder that has none."""
    return sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))


def frozen_model(role: str, path: str | Path) -> FrozenModel:
    """Identify a model the job does not train by its resolved path and one sha256 over its weight files.

    The files are hashed in name order, each preceded by its name and a NUL byte, so renaming or
    re-splitting the shards changes the checksum as surely as changing a weight does.
    """
    model_dir = Path(path).resolve()
    files = _weight_files(model_dir)
    if not files:
        raise CheckpointError(f"the {role} model folder '{model_dir}' has no weight files (*.safetensors or *.bin) "
                              "to record in the checkpoint; point the config at a saved model folder")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode("utf-8") + b"\0")
        _update_from_file(digest, file)
    return FrozenModel(role=role, path=str(model_dir), sha256=digest.hexdigest())


# ---- writing -------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _data_files(folder: Path) -> list[tuple[str, Path]]:
    """(relative POSIX path, path) of every regular file under `folder` except the manifest, sorted by path."""
    found = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = Path(dirpath) / name
            relative = path.relative_to(folder).as_posix()
            if relative not in (layout.MANIFEST, layout.MANIFEST + ".tmp") and path.is_file():
                found.append((relative, path))
    return sorted(found)


def _entry(relative: str, path: Path) -> FileEntry:
    """Size and sha256 of one file; the file is fsynced as well, so the manifest never outlives its data."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return FileEntry(path=relative, bytes=path.stat().st_size, sha256=file_sha256(path))


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so a reader (or a crash) sees the old file or the whole new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _finished_name(incomplete_dir: Path, step: int) -> Path:
    """The ``step-N`` folder `incomplete_dir` becomes, or CheckpointError when it is no unfinished save of `step`."""
    parsed = layout.parse_step_dir(incomplete_dir)
    if parsed is None or parsed[1]:
        raise CheckpointError(f"'{incomplete_dir}' is not an unfinished checkpoint folder (step-NNNNNNNN"
                              f"{layout.INCOMPLETE_SUFFIX}); only a save still being written can be finalized")
    if parsed[0] != step:
        raise CheckpointError(f"'{incomplete_dir}' holds step {parsed[0]}, not step {step}; finalize the folder "
                              "of the step that was saved")
    if not incomplete_dir.is_dir():
        raise CheckpointError(f"checkpoint folder '{incomplete_dir}' does not exist; nothing was saved there")
    final = layout.step_dir(incomplete_dir.parent, step)
    if final.exists():
        raise CheckpointError(f"cannot finalize '{incomplete_dir}': '{final}' already exists; a finished checkpoint "
                              "is never overwritten, remove it first if it is to be replaced")
    return final


def finalize(incomplete_dir: str | Path, *, step: int, config_sha256: str, controllers: int, trainer_devices: int,
             devices: int, frozen: list[FrozenModel], save_seconds: float = 0.0) -> Path:
    """Write the manifest of a fully written ``step-N.incomplete`` folder and rename it to ``step-N``.

    Every file under the folder is listed (sorted relative POSIX paths, size, sha256) and fsynced;
    the manifest is written atomically; only then is the folder renamed, and the rename fsynced.
    Returns the finished folder.
    """
    source = Path(incomplete_dir)
    final = _finished_name(source, step)
    files = [_entry(relative, path) for relative, path in _data_files(source)]
    manifest = Manifest(format=layout.FORMAT_VERSION, step=step,
                        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        config_sha256=config_sha256, controllers=controllers, trainer_devices=trainer_devices,
                        devices=devices, files=files, frozen=list(frozen), save_seconds=float(save_seconds))
    for dirpath, _, _ in os.walk(source):
        _fsync_dir(Path(dirpath))
    write_atomically(source / layout.MANIFEST, manifest.to_json())
    os.replace(source, final)
    _fsync_dir(final.parent)
    return final


# ---- reading and verifying -----------------------------------------------------------------------


def _advice(checkpoint: Path) -> str:
    """What to do about a folder that cannot be used as a checkpoint (the sentence ending the paragraph)."""
    if layout.parse_step_dir(checkpoint) is None and not (checkpoint / layout.MANIFEST).exists():
        return ("give a checkpoint folder, a step-NNNNNNNN folder under a run's checkpoints/ "
                "(`gcore-rl checkpoints RUN_DIR` lists them)")
    return (f"resume from an earlier checkpoint instead (`gcore-rl checkpoints {checkpoint.parent}` lists them, "
            "`run.resume=PATH` picks one)")


def _unusable(checkpoint: Path, what: str) -> CheckpointError:
    """A CheckpointError of one paragraph: the folder, what is wrong with which file, what to do."""
    return CheckpointError(f"checkpoint '{checkpoint}' cannot be used: {what}; {_advice(checkpoint)}")


def read_manifest(checkpoint: str | Path) -> Manifest:
    """The manifest of a checkpoint folder; CheckpointError naming the file when it is missing or damaged."""
    folder = Path(checkpoint)
    path = folder / layout.MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint '{folder}' does not exist or is not a folder; `gcore-rl checkpoints "
                              "RUN_DIR` lists a run's checkpoints")
    if not path.is_file():
        raise _unusable(folder, f"it has no '{path}', so it is not a finished checkpoint (a save writes the "
                                "manifest last)")
    try:
        return Manifest.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        reason = "it is not valid JSON" if isinstance(exc, json.JSONDecodeError) else str(exc).strip()
        raise _unusable(folder, f"'{path}' is damaged: {reason}") from exc


def verify(checkpoint: str | Path, checksums: bool = True) -> Manifest:
    """Check a finished checkpoint against its manifest and return the manifest.

    Every listed file must exist with its listed size and, with `checksums`, its listed sha256
    (``trainer/.metadata`` is always checksummed); then DCP's metadata is read with the restricted
    unpickler and every shard it points into must be listed and long enough.
    """
    folder = Path(checkpoint)
    parsed = layout.parse_step_dir(folder)
    if parsed is not None and not parsed[1]:
        raise _unusable(folder, "its save never finished (the folder still ends in "
                                f"'{layout.INCOMPLETE_SUFFIX}'), so it may lack files")
    manifest = read_manifest(folder)
    if parsed is not None and parsed[0] != manifest.step:
        raise _unusable(folder, f"'{folder / layout.MANIFEST}' records step {manifest.step}, but the folder is "
                                f"named for step {parsed[0]}")
    for entry in manifest.files:
        _check_size(folder, entry)
    for entry in manifest.files:
        if checksums or entry.path in DCP_METADATA_FILES:
            _check_sha256(folder, entry)
    _check_dcp_metadata(folder, manifest, layout.TRAINER_DIR)
    if (folder / layout.CRITIC_DIR).exists():  # a critic apart from the actor: listed and checked like trainer/
        _check_dcp_metadata(folder, manifest, layout.CRITIC_DIR)
    return manifest


def _check_size(folder: Path, entry: FileEntry) -> None:
    """The listed file exists and has the listed size."""
    path = folder / entry.path
    if not path.is_file():
        raise _unusable(folder, f"'{path}' is missing (the manifest lists it with {entry.bytes} bytes)")
    found = path.stat().st_size
    if found != entry.bytes:
        raise _unusable(folder, f"'{path}' has {found} bytes, but the manifest lists {entry.bytes} (the file was "
                                f"{'truncated' if found < entry.bytes else 'changed'} after the save)")


def _check_sha256(folder: Path, entry: FileEntry) -> None:
    """The listed file's bytes have the listed sha256."""
    path = folder / entry.path
    if file_sha256(path) != entry.sha256:
        raise _unusable(folder, f"'{path}' does not match its sha256 in the manifest (its bytes changed after "
                                "the save)")


def _check_dcp_metadata(folder: Path, manifest: Manifest, tensors_dir: str) -> None:
    """DCP's metadata of `tensors_dir` is listed, unpickles under the restrictions, and points only into
    listed, long enough files."""
    listed = {entry.path: entry.bytes for entry in manifest.files}
    index = f"{tensors_dir}/.metadata"
    if index not in listed:
        raise _unusable(folder, f"'{folder / layout.MANIFEST}' lists no '{index}', so the tensors of "
                                f"'{tensors_dir}/' were not saved in it")
    metadata = read_dcp_metadata(folder, tensors_dir)
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is None:
            continue
        shard = f"{tensors_dir}/{relative}"
        if shard not in listed:
            raise _unusable(folder, f"'{folder / index}' stores tensors in '{folder / shard}', which the "
                                    "manifest does not list (the save did not write it)")
        if info.offset + info.length > listed[shard]:
            raise _unusable(folder, f"'{folder / index}' reads up to byte {info.offset + info.length} of "
                                    f"'{folder / shard}', which has {listed[shard]} bytes")


# ---- DCP's metadata --------------------------------------------------------------------------


def read_dcp_metadata(checkpoint: str | Path, tensors_dir: str = layout.TRAINER_DIR) -> Any:
    """DCP's `Metadata` of a checkpoint's DCP folder `tensors_dir` (the trainer's, or the critic's),
    read with the restricted `MetadataUnpickler`.

    Call it after the file's checksum was checked (`verify` does). CheckpointError when the file is
    missing, names a global the unpickler refuses, or is not DCP metadata.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    folder = Path(checkpoint)
    path = folder / tensors_dir / ".metadata"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _unusable(folder, f"'{path}' cannot be read ({exc.strerror or exc})") from exc
    try:
        metadata = unpickle_metadata(data)
    except RefusedGlobal as exc:
        raise _unusable(folder, f"gcore-rl refuses to unpickle {exc.qualified_name} from '{path}' (DCP metadata "
                                "is made only of DCP's own classes, torch sizes and dtypes), so the file was not "
                                "written by the save") from exc
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError,
            KeyError) as exc:
        raise _unusable(folder, f"'{path}' is not a DCP metadata file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise _unusable(folder, f"'{path}' holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


# ---- a root of checkpoints ----------------------------------------------------------------------


def resolve_root(path: str | Path) -> Path:
    """The checkpoint root for `path`: ``path/checkpoints`` when `path` is a run folder that has one, else `path`."""
    candidate = Path(path) / "checkpoints"
    return candidate if candidate.is_dir() else Path(path)


def _folder_bytes(folder: Path) -> int:
    """Total size of the regular files under `folder`."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _info(folder: Path, step: int, complete: bool) -> CheckpointInfo:
    """What `list_checkpoints` reports of one folder (manifest fields only when it has a readable manifest)."""
    manifest = None
    if complete:
        try:
            manifest = read_manifest(folder)
        except CheckpointError:
            manifest = None
    return CheckpointInfo(step=step, path=folder, complete=complete, bytes=_folder_bytes(folder),
                          created=manifest.created if manifest else None,
                          controllers=manifest.controllers if manifest else None,
                          trainer_devices=manifest.trainer_devices if manifest else None,
                          devices=manifest.devices if manifest else None)


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """The checkpoint folders under a checkpoint root or run folder, by step (unfinished before finished).

    Folders whose names are not ``step-NNNNNNNN[.incomplete]`` are ignored; a root that does not
    exist holds no checkpoints.
    """
    folder = resolve_root(root)
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        parsed = layout.parse_step_dir(child)
        if parsed is not None and child.is_dir():
            found.append(_info(child, *parsed))
    return sorted(found, key=lambda info: (info.step, info.complete))


def newest_valid(root: str | Path, checksums: bool = True) -> tuple[Path | None, list[str]]:
    """The newest finished checkpoint that verifies (None when there is none), and why each newer one was skipped.

    Unfinished saves newer than the one returned are skipped too (their message says so); with no
    valid checkpoint every folder's reason is listed.
    """
    skipped: list[str] = []
    for info in reversed(list_checkpoints(root)):
        if not info.complete:
            skipped.append(f"'{info.path}' is a save that never finished (skipped)")
            continue
        try:
            verify(info.path, checksums=checksums)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        return info.path, skipped
    return None, skipped


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete finished checkpoints beyond the newest `keep`, and unfinished ones older than the newest finished one.

    The newest finished checkpoint is never deleted (whether it verifies is not checked: call this
    after a save succeeded); unfinished folders newer than it may still be written and stay.
    Returns the deleted folders.
    """
    if keep < 1:
        raise ValueError(f"prune keeps at least one checkpoint, got keep={keep}")
    checkpoints = list_checkpoints(root)
    complete = [info for info in checkpoints if info.complete]
    if not complete:
        return []
    newest_step = complete[-1].step
    doomed = [info.path for info in complete[:-keep]]
    doomed += [info.path for info in checkpoints if not info.complete and info.step < newest_step]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
