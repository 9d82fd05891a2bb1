"""Saving and loading a `PolicyTrainer`'s state: tensors through DCP (sharded, reshardable), the rest as JSON.

The tensors go to a `torch.distributed.checkpoint` folder, written by every trainer rank for its
own shards, so a checkpoint reloads on a different number of trainer devices (DCP reshards on
load). Its state dict (`dcp_tree`) is ``{"model": {key: parameters}, "moments": {key: AdamW's
exp_avg and exp_avg_sq}}`` (and the same under ``"critic"``), where each entry stacks the tensors of
one dtype and shape (`checkpoint.stacking`: DCP's cost per entry, not per byte, dominates a small
model's save), and the JSON's ``stacks`` name each entry's members. The non-tensor state (LR
scheduler, optimiser steps, param groups, AdamW's per-parameter step counts, the stacks) is the same
on every rank; rank 0 writes it as JSON, so loading never unpickles it.

A save is asynchronous: `TrainerCheckpointer.save` copies the trainer's shards to host memory
(the staging the next update cannot disturb, into host buffers kept for the next save) and returns;
a writer thread saves them with `dcp.save`, over a gloo process group of its own so its collectives never
interleave with the training's (one trainer rank saves without a group). `wait` blocks until the write is complete. Files are not fsynced
here: the checkpoint's manifest is written only after every file has been (`checkpoint.manifest.finalize`).

Unless the state is small (`writes_in_background`): a write of a few megabytes takes tens of
milliseconds, which a writer thread does not hide on a CPU whose cores all train (its Python calls
take the GIL from the training thread, its copies take a core). Measured on the demo model (9.7 MB
in 12 entries; BENCHMARKS.md 'Checkpoint cost'), a save adds a median 4.9-5.2% of a step written in
line and 6.5% by the thread, within the noise of each other. Under `auto` a state under `BACKGROUND_BYTES`
is therefore written in the calling thread, where it costs exactly its time; a larger one (a 0.5B model's
6 GB, seconds of writing) is written in the background, where its bytes are hidden.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor, Shard

from gcore_rl.checkpoint import stacking
from gcore_rl.checkpoint.manifest import read_dcp_metadata
from gcore_rl.disk import writing
from gcore_rl.errors import CheckpointError
from gcore_rl.training.policy_trainer import PolicyTrainer

__all__ = ["TrainerCheckpointer", "split_state", "join_state", "dcp_tree", "writes_in_background"]

BACKGROUND_BYTES = 64 * 1024 * 1024
"""Under `run.checkpoint_write=auto`, the size of a trainer state (global, all ranks) from which a write
goes to the writer thread: below it the write takes under ~0.1 s in line (~0.75 GB/s into the page
cache on a 2-core x86 CPU), which a thread saves nothing of while training uses every core (see
the module docstring)."""

WriteMode = Literal["auto", "background", "blocking"]

# a save by one trainer rank runs DCP without a process group (`TrainerCheckpointer._save_group`), on purpose
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning)

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter moments, stacked in this order into one DCP entry."""


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A `PolicyTrainer.state_dict()` as (tensors for DCP, JSON-serialisable rest).

    Tensors: ``{"model": {name: tensor}, "optimizer": {"state": {name: {"exp_avg", "exp_avg_sq", "step"}}}}``,
    plus the same under ``"critic"`` when the trainer has one.
    Rest: ``{"param_groups": [...], "scheduler": {...}, "optimiser_steps": int, "updates": int}``, plus
    ``"critic": {"param_groups", "scheduler"}``.
    """
    tensors, rest = _split_model_state(state)
    rest.update(optimiser_steps=int(state["optimiser_steps"]), updates=int(state.get("updates", 0)))
    if "critic" in state:
        tensors["critic"], rest["critic"] = _split_model_state(state["critic"])
    return tensors, rest


def join_state(tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `split_state`."""
    state = {**_join_model_state(tensors, rest), "optimiser_steps": rest["optimiser_steps"],
             "updates": rest.get("updates", 0)}
    if "critic" in tensors:
        state["critic"] = _join_model_state(tensors["critic"], rest["critic"])
    return state


def _split_model_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    optimizer = state["optimizer"]
    return ({"model": state["model"], "optimizer": {"state": optimizer["state"]}},
            {"param_groups": optimizer["param_groups"], "scheduler": state["scheduler"]})


def _join_model_state(tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    return {"model": tensors["model"], "optimizer": {"state": tensors["optimizer"]["state"],
                                                     "param_groups": rest["param_groups"]},
            "scheduler": rest["scheduler"]}


def _named(tensors: dict[str, Any]) -> dict[str, dict[stacking.Member, torch.Tensor]]:
    """`split_state`'s tensors of one model by part and (name, slot): ``{"model": {(name, "param"): tensor},
    "moments": {(name, "exp_avg"): tensor, (name, "exp_avg_sq"): tensor}}``."""
    state = tensors["optimizer"]["state"]
    return {"model": {(name, "param"): tensor for name, tensor in tensors["model"].items()},
            "moments": {(name, key): per[key] for name, per in state.items() for key in MOMENTS}}


def dcp_tree(tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The DCP state dict of `split_state`'s tensors, its layout, and AdamW's step counts for the JSON.

    Returns (tree, stacks, steps): tree ``{"model": {key: (tensor, ...)}, "moments": {key: (tensor, ...)}}``
    (plus ``"critic"`` with the same), each tuple a group of same-shaped tensors that `_stage` stacks
    into one entry of shape (members, *shape) (`checkpoint.stacking`); stacks, the same nesting with
    each tuple's `stacking.Layout` members; steps ``{name: float}`` (plus ``"critic"``), AdamW's
    per-parameter ``step`` counts.
    """
    tree: dict[str, Any] = {}
    stacks: dict[str, Any] = {}
    for part, named in _named(tensors).items():
        tree[part], stacks[part] = stacking.group(named)
    steps: dict[str, Any] = {name: float(per["step"]) for name, per in tensors["optimizer"]["state"].items()}
    if "critic" in tensors:
        tree["critic"], stacks["critic"], steps["critic"] = dcp_tree(tensors["critic"])
    return tree, stacks, steps


def _saved_tree(tensors: dict[str, Any], stacks: dict[str, Any], where: str = "") -> tuple[dict[str, Any], list[str]]:
    """`split_state`'s tensors grouped as a checkpoint's `stacks` say (what a load fills), and what does not fit."""
    tree: dict[str, Any] = {}
    problems: list[str] = []
    for part, named in _named(tensors).items():
        tree[part], found = stacking.regroup(stacks.get(part, {}), named)
        problems.extend(f"{where}{line}" for line in found)
    if "critic" in tensors or "critic" in stacks:
        if "critic" not in tensors or "critic" not in stacks:
            problems.append("the checkpoint has a critic and this job has none" if "critic" in stacks
                            else "this job has a critic and the checkpoint has none")
        else:
            tree["critic"], found = _saved_tree(tensors["critic"], stacks["critic"], "critic ")
            problems.extend(found)
    return tree, problems


def _restore_steps(tensors: dict[str, Any], steps: dict[str, Any]) -> None:
    """Put the JSON's AdamW step counts back into `split_state`'s tensors (the inverse of `dcp_tree`'s steps)."""
    for name, per in tensors["optimizer"]["state"].items():
        per["step"] = torch.full_like(per["step"], steps[name])
    if "critic" in tensors:
        _restore_steps(tensors["critic"], steps["critic"])


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _stage(value: Any, buffers: dict[str, torch.Tensor], path: str = "", copy: bool = True) -> Any:
    """A host copy of every tensor in a nested dict, a tuple of same-shaped tensors stacked into one.

    DTensors stay DTensors over the copied local shards (a stacked tuple's shard dimension shifts by
    one). The copies go into `buffers` (host tensors by key path), reused from one save to the next when
    shape and dtype still match: a fresh multi-GiB allocation per save costs as much as the copy
    (the pages are faulted in and zeroed first), and on CUDA the buffers are pinned. With `copy`
    false the buffers are only allocated (the targets of a load).
    """
    if isinstance(value, dict):
        return {key: _stage(item, buffers, f"{path}.{key}", copy) for key, item in value.items()}
    if not torch.is_tensor(value) and not isinstance(value, tuple):
        return value
    parts = value if isinstance(value, tuple) else (value,)
    local = _local(parts[0])
    shape = (len(parts), *local.shape) if isinstance(value, tuple) else local.shape
    buffer = buffers.get(path)
    if buffer is None or buffer.shape != shape or buffer.dtype != local.dtype:
        # pinned for the device-to-host copies of a save; a load's targets are only read into
        buffer = buffers[path] = torch.empty(shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda and copy)
    if copy:
        for index, part in enumerate(parts):
            (buffer[index] if isinstance(value, tuple) else buffer).copy_(_local(part).detach())
    first = parts[0]
    if not isinstance(first, DTensor):
        return buffer
    if not isinstance(value, tuple):
        return DTensor.from_local(buffer, first.device_mesh, first.placements, run_check=False,
                                  shape=first.shape, stride=first.stride())
    placements = [Shard(p.dim + 1) if isinstance(p, Shard) else p for p in first.placements]
    global_shape = torch.Size((len(parts), *first.shape))
    return DTensor.from_local(buffer, first.device_mesh, placements, run_check=False, shape=global_shape,
                              stride=torch.empty(global_shape, device="meta").stride())


def _entries(tree: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], tuple]]:
    """Every stacked entry of a `dcp_tree`: (its key path, its tuple of tensors)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _entries(value, (*path, key))
        elif isinstance(value, tuple):
            yield (*path, key), value


def _nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """``{path[0]: {path[1]: ... value}}``: one entry as a DCP state dict."""
    for key in reversed(path):
        value = {key: value}
    return value


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _unfit(folder: Path, what: str) -> str:
    """The one-paragraph message of a trainer state in `folder` that does not fit this model."""
    return (f"the trainer state in '{folder}' does not fit this model: {what}; the checkpoint was saved from a model "
            "of another shape, or model.path now holds another model: resume with the model it was saved from, or "
            "start a new run")


def _check_shape(key: str, target: torch.Tensor, metadata: Any, folder: Path) -> None:
    """CheckpointError when the stacked entry `key` is missing from the DCP metadata or saved in another shape."""
    entry = metadata.state_dict_metadata.get(key)
    if entry is None or getattr(entry, "size", target.shape) != target.shape:
        found = "is not in it" if entry is None else f"has shape {tuple(entry.size)}"
        raise CheckpointError(_unfit(folder, f"the stack {key} {found}, this model's is {tuple(target.shape)}"))


def _global_tensors(tree: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of a nested state dict (DTensors as they are: their shapes are global)."""
    out: list[torch.Tensor] = []
    for value in tree.values():
        out.extend(_global_tensors(value) if isinstance(value, dict) else [value] if torch.is_tensor(value) else [])
    return out


def writes_in_background(mode: WriteMode, tensors: list[torch.Tensor]) -> bool:
    """Whether a save of these DCP entries (global shapes) is written by the writer thread: always under
    'background', never under 'blocking', and under 'auto' when they hold at least `BACKGROUND_BYTES`
    (see the module docstring). From global shapes, so every trainer rank of a collective save decides alike."""
    if mode != "auto":
        return mode == "background"
    return sum(t.numel() * t.element_size() for t in tensors) >= BACKGROUND_BYTES


def _write(staged: dict[str, Any], writer: FileSystemWriter, group: dist.ProcessGroup | None) -> None:
    """`dcp.save` of staged tensors (the writer thread's job).

    DCP writes each tensor with `torch.save`, whose zip records carry a CRC32 by default; the
    checkpoint's manifest has every file's sha256 (checked before a resume loads it), so the CRC, half
    of `torch.save`'s time on a small model's tensors, is turned off. The setting is process-wide;
    gcore-rl saves nothing else with `torch.save`, and `torch.load` reads files with or without it.
    """
    torch.serialization.set_crc32_options(False)
    dcp.save(staged, storage_writer=writer, process_group=group, no_dist=group is None)


class TrainerCheckpointer:
    """Asynchronous saves and synchronous loads of one trainer rank's state (see the module docstring).

    Every trainer rank makes the same calls in the same order (`save`, `wait` and `load` are
    collectives over the trainer group).
    """

    def __init__(self, mode: WriteMode = "auto") -> None:
        self.mode = mode
        self._group: dist.ProcessGroup | None = None
        self._pending: Future | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # host copies of the last save, reused by the next
        self._shards: tuple[Path, str, int] = (Path("."), "", 0)  # `writing`'s (folder, what, bytes) of the last save
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.last_stage_seconds = 0.0
        self.last_in_background = False

    def _save_group(self) -> dist.ProcessGroup | None:
        """A gloo group of the trainer ranks for the background writes (created at the first save); None for
        one trainer rank, whose save needs no collective (DCP's plan and metadata exchange over a group of
        one cost a third of a small model's write)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(self, trainer: PolicyTrainer, directory: str | Path, tensors_dir: str, json_name: str) -> None:
        """Stage this rank's state to host memory and write it under `directory`.

        Tensors go to `directory/tensors_dir` (DCP), the rest to `directory/json_name` (rank 0).
        Returns once the state is staged and, unless `writes_in_background`, written: the trainer may
        update its weights while a background write runs. A previous save still in flight is waited for first.
        """
        self.wait()
        started = time.perf_counter()
        tensors, rest = split_state(trainer.state_dict())
        tree, rest["stacks"], rest["steps"] = dcp_tree(tensors)
        staged = _stage(tree, self._buffers)
        self.last_stage_seconds = time.perf_counter() - started
        out = Path(directory)
        tensors = _global_tensors(staged)
        size = sum(t.numel() * t.element_size() for t in tensors)
        self._shards = (out / tensors_dir, "the trainer's checkpoint shards", size)
        with writing(out, "the trainer's checkpoint", size):
            out.mkdir(parents=True, exist_ok=True)
            if _is_main():  # inside the unfinished folder: no fsync, the manifest comes after one of every file
                (out / json_name).write_text(json.dumps(rest, indent=1) + "\n")
        group = self._save_group()
        # already staged: a plain save in the writer thread (dcp.async_save would stage a second copy)
        writer = FileSystemWriter(out / tensors_dir, sync_files=False)
        self.last_in_background = writes_in_background(self.mode, tensors)
        if self.last_in_background:
            self._pending = self._writer.submit(_write, staged, writer, group)
        else:
            with writing(*self._shards):
                _write(staged, writer, group)

    def wait(self) -> float:
        """Block until the save in flight (if any) is written; returns the seconds spent waiting."""
        if self._pending is None:
            return 0.0
        started = time.perf_counter()
        pending, self._pending = self._pending, None
        with writing(*self._shards):  # a background write that failed stops the run here, at a step boundary
            pending.result()
        return time.perf_counter() - started

    def load(self, trainer: PolicyTrainer, directory: str | Path, tensors_dir: str, json_name: str) -> None:
        """Restore `trainer` from a checkpoint folder saved by `save`, on any number of trainer ranks."""
        self.wait()
        source = Path(directory)
        tensors, _ = split_state(trainer.state_dict())
        try:
            rest = json.loads((source / json_name).read_text())
            tree, problems = _saved_tree(tensors, rest.pop("stacks"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"'{source / json_name}' does not say how the trainer's tensors are stacked "
                                  f"({type(exc).__name__}: {exc}); it was not written by this version's save: resume "
                                  "from another checkpoint, or start a new run") from None
        if problems:
            raise CheckpointError(_unfit(source / tensors_dir, "; ".join(problems[:3])
                                         + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")))
        metadata = read_dcp_metadata(source, tensors_dir)
        try:
            # one entry at a time, into a newly allocated stack copied into the trainer's tensors: host memory
            # for one entry beside the trainer, not a second copy of its whole state
            for path, parts in _entries(tree):
                target = _stage(parts, {}, copy=False)
                _check_shape(".".join(path), target, metadata, source / tensors_dir)
                dcp.load(_nested(path, target), checkpoint_id=str(source / tensors_dir), no_dist=not dist.is_initialized())
                for index, part in enumerate(parts):
                    _local(part).copy_(_local(target)[index])
            _restore_steps(tensors, rest.pop("steps"))
            trainer.load_state_dict(join_state(tensors, rest))
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - DCP and torch raise many types for tensors that do not fit
            raise CheckpointError(_unfit(source / tensors_dir, " ".join(str(exc).split())[:600])) from None

    def close(self) -> None:
        """Finish the save in flight and release the background group."""
        self.wait()
        self._writer.shutdown()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
