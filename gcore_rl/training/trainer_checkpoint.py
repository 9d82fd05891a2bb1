"""Saving and loading a `PolicyTrainer`'s state: tensors through DCP (sharded, reshardable), the rest as JSON.

The tensors (parameters and AdamW moments, FSDP2 DTensors keyed by parameter name) go to a
`torch.distributed.checkpoint` folder, written by every trainer rank for its own shards, so a
checkpoint reloads on a different number of trainer devices (DCP reshards on load). The non-tensor
state (LR scheduler, optimiser steps, optimiser param groups) is the same on every rank; rank 0
writes it as JSON, so loading never unpickles it.

A save is asynchronous: `TrainerCheckpointer.save` copies the trainer's shards to host memory
(the staging the next update cannot disturb, into host buffers kept for the next save) and returns;
a writer thread saves them with `dcp.save`, over a gloo process group of its own so its collectives never
interleave with the training's. `wait` blocks until the write is complete.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from gcore_rl.checkpoint.manifest import read_dcp_metadata, write_atomically
from gcore_rl.errors import CheckpointError
from gcore_rl.training.policy_trainer import PolicyTrainer

__all__ = ["TrainerCheckpointer", "split_state", "join_state"]


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


def _stage(value: Any, buffers: dict[str, torch.Tensor], path: str = "") -> Any:
    """A host copy of every tensor in a nested dict (DTensors stay DTensors over copied local shards).

    The copies go into `buffers` (host tensors by key path), reused from one save to the next when
    shape and dtype still match: a fresh multi-GiB allocation per save costs as much as the copy
    (the pages are faulted in and zeroed first), and on CUDA the buffers are pinned.
    """
    if isinstance(value, dict):
        return {key: _stage(item, buffers, f"{path}.{key}") for key, item in value.items()}
    if not torch.is_tensor(value):
        return value
    local = value.to_local() if isinstance(value, DTensor) else value
    buffer = buffers.get(path)
    if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
        buffer = buffers[path] = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                             pin_memory=local.is_cuda)
    buffer.copy_(local.detach())
    if isinstance(value, DTensor):
        return DTensor.from_local(buffer, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return buffer


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _flat_shapes(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Size]:
    """Global shapes of the tensors of a nested state dict, by DCP's dotted key."""
    out: dict[str, torch.Size] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat_shapes(value, f"{prefix}{key}."))
        elif torch.is_tensor(value):
            out[f"{prefix}{key}"] = value.shape
    return out


def _check_shapes(tensors: dict[str, Any], metadata: Any, folder: Path) -> None:
    """CheckpointError naming the first tensor whose saved shape differs from this trainer's, or that is missing."""
    saved = metadata.state_dict_metadata
    for key, shape in _flat_shapes(tensors).items():
        entry = saved.get(key)
        if entry is None or getattr(entry, "size", shape) != shape:
            found = "is not in it" if entry is None else f"has shape {tuple(entry.size)}"
            raise CheckpointError(f"the trainer state in '{folder}' does not fit this model: {key} {found}, this "
                                  f"model's is {tuple(shape)}; the checkpoint was saved from a model of another "
                                  "shape, or model.path now holds another model: resume with the model it was saved "
                                  "from, or start a new run")


class TrainerCheckpointer:
    """Asynchronous saves and synchronous loads of one trainer rank's state (see the module docstring).

    Every trainer rank makes the same calls in the same order (`save`, `wait` and `load` are
    collectives over the trainer group).
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._pending: Future | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # host copies of the last save, reused by the next
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.last_stage_seconds = 0.0

    def _save_group(self) -> dist.ProcessGroup | None:
        """A gloo group of the trainer ranks for the background writes (created at the first save)."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(self, trainer: PolicyTrainer, directory: str | Path, tensors_dir: str, json_name: str) -> None:
        """Stage this rank's state to host memory and start writing it under `directory`.

        Tensors go to `directory/tensors_dir` (DCP), the rest to `directory/json_name` (rank 0).
        Returns once the state is staged: the trainer may update its weights while the write runs.
        A previous save still in flight is waited for first.
        """
        self.wait()
        started = time.perf_counter()
        tensors, rest = split_state(trainer.state_dict())
        staged = _stage(tensors, self._buffers)
        self.last_stage_seconds = time.perf_counter() - started
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if _is_main():
            write_atomically(out / json_name, json.dumps(rest, indent=1) + "\n")
        group = self._save_group()
        # already staged: a plain save in the writer thread (dcp.async_save would stage a second copy)
        self._pending = self._writer.submit(dcp.save, staged, checkpoint_id=str(out / tensors_dir),
                                            process_group=group, no_dist=group is None)

    def wait(self) -> float:
        """Block until the save in flight (if any) is written; returns the seconds spent waiting."""
        if self._pending is None:
            return 0.0
        started = time.perf_counter()
        pending, self._pending = self._pending, None
        pending.result()
        return time.perf_counter() - started

    def load(self, trainer: PolicyTrainer, directory: str | Path, tensors_dir: str, json_name: str) -> None:
        """Restore `trainer` from a checkpoint folder saved by `save`, on any number of trainer ranks."""
        self.wait()
        source = Path(directory)
        tensors, _ = split_state(trainer.state_dict())
        _check_shapes(tensors, read_dcp_metadata(source), source / tensors_dir)
        try:
            dcp.load(tensors, checkpoint_id=str(source / tensors_dir), no_dist=not dist.is_initialized())
            rest = json.loads((source / json_name).read_text())
            trainer.load_state_dict(join_state(tensors, rest))
        except Exception as exc:  # noqa: BLE001 - DCP and torch raise many types for tensors that do not fit
            detail = " ".join(str(exc).split())[:600]
            raise CheckpointError(f"the trainer state in '{source / tensors_dir}' does not fit this model ({detail}); "
                                  f"the checkpoint was saved from a model of another shape, or model.path now holds "
                                  "another model: resume with the model it was saved from, or start a new run") from None

    def close(self) -> None:
        """Finish the save in flight and release the background group."""
        self.wait()
        self._writer.shutdown()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
