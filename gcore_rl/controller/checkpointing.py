"""A controller's part of the run's checkpoints: what it saves, when, and how a resumed run takes it up.

Every `run.checkpoint_every` steps, after the step's weight sync, each controller

1. asks its slice's trainers to stage their state and start writing it (`SliceClient.save_checkpoint`;
   the write runs while the next step trains),
2. writes its own state (`ControllerState`: the step, the prompt sampler's position, the
   dynamic-sampling EMA and buffered groups, the rebalancer's history and split, the rollouts made
   ahead under bounded staleness (`ahead`, in step order), the summary so far) as `controller-<k>.json`;

and at the end of the next step (or of the run) waits for the trainers' writes, meets the other
controllers, and controller 0 completes the checkpoint: it lists every file with its size and
checksum in the manifest and renames `step-N.incomplete` to `step-N` (in a background thread,
joined when the next checkpoint is completed or the run ends; when step N + 1 saves too, started
only once that save is staged, so the two do not compete), then deletes checkpoints beyond
`run.keep_checkpoints`. So the save of step N is in progress during step N + 1, and a crash at any
moment leaves the previous complete checkpoint as it was. The config's YAML and hash are computed once per run: the config does not
change while it runs.

Random state is not saved: every seed of a step is a function of (`run.seed`, step, controller or
device) (`controller/seeds.py`), and the global generators are reseeded from it at the start of
each step, so a resumed step draws what the uninterrupted one drew, on any number of devices.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from gcore_rl.algos.dynamic_sampling import Group, StepBatch
from gcore_rl.checkpoint.layout import (
    CONFIG,
    INCOMPLETE_SUFFIX,
    MODEL_DIR,
    checkpoint_root,
    controller_file,
    step_dir,
)
from gcore_rl.checkpoint.manifest import (
    FrozenModel,
    config_sha256,
    finalize,
    frozen_model,
    prune,
)
from gcore_rl.config import JobConfig, frozen_model_paths
from gcore_rl.configlib import to_dict, yaml_text
from gcore_rl.controller.program import GroupPayload, StepRollout
from gcore_rl.disk import free_bytes, writing
from gcore_rl.distributed import DistInfo, barrier
from gcore_rl.errors import CheckpointError
from gcore_rl.faults import maybe_fail
from gcore_rl.placement.rebalance import RolloutLoad
from gcore_rl.records import Completion

STATE_VERSION = 1


# ---- JSON codecs ------------------------------------------------------------------------


def encode_payload(payload: GroupPayload) -> dict[str, Any]:
    """A group's payload as JSON (floats are written exactly: Python's repr round-trips). A prompt's images
    are not written: the row (`row_id`) has them, and `decode_payload`'s caller attaches them again."""
    return {"row_id": payload.row_id,
            "completions": [{**asdict(c), "prompt_ids": list(c.prompt_ids)} for c in payload.completions],
            "greedy_reward": payload.greedy_reward}


def decode_payload(entry: dict[str, Any]) -> GroupPayload:
    """The inverse of `encode_payload`."""
    return GroupPayload(row_id=int(entry["row_id"]), completions=[Completion(**c) for c in entry["completions"]],
                        greedy_reward=entry.get("greedy_reward"))


def encode_rollout(rollout: StepRollout, encode: Callable[[GroupPayload], dict[str, Any]] = encode_payload) -> dict[str, Any]:
    """A step's rollout (groups, mask, statistics, drawn rows) as JSON (`encode` writes each group's payload)."""
    batch = rollout.groups
    return {"groups": [{"key": g.key, "rewards": list(g.rewards), "payload": encode(g.payload),
                        "version": g.version} for g in batch.groups],
            "mask": list(batch.mask), "waves": batch.waves, "generated_groups": batch.generated_groups,
            "valid_fraction_observed": batch.valid_fraction_observed, "stale_dropped": batch.stale_dropped,
            "stats": rollout.stats,
            "row_ids": list(rollout.row_ids)}


def decode_rollout(entry: dict[str, Any], decode: Callable[[dict[str, Any]], GroupPayload] = decode_payload) -> StepRollout:
    """The inverse of `encode_rollout` (`decode` reads each group's payload)."""
    groups = [Group(key=g["key"], rewards=tuple(g["rewards"]), payload=decode(g["payload"]), version=int(g.get("version", 0)))
              for g in entry["groups"]]
    batch = StepBatch(groups=groups, mask=[bool(m) for m in entry["mask"]], waves=int(entry["waves"]),
                      generated_groups=int(entry["generated_groups"]),
                      valid_fraction_observed=float(entry["valid_fraction_observed"]),
                      stale_dropped=int(entry.get("stale_dropped", 0)))
    return StepRollout(groups=batch, stats=dict(entry["stats"]), row_ids=list(entry["row_ids"]))


# ---- what a controller saves ------------------------------------------------------------


@dataclass
class ControllerState:
    """Everything of one controller that the step after `step` depends on (JSON, see the module docstring).

    `drawn_rows` are the global rows the sampler's current `epoch` has handed out: what a resume
    on another number of controllers needs to continue the epoch without repeating or skipping a
    prompt.
    """

    step: int
    controllers: int
    sampler: dict[str, Any]
    epoch: int
    drawn_rows: list[int]
    waves: dict[str, Any]
    loads: list[dict[str, float]]
    rollout_devices: int
    plan_version: int
    ahead: list[dict[str, Any]] | dict[str, Any] | None
    rewards: list[float]
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    version: int = STATE_VERSION
    tensors: dict[str, Tensor] = field(default_factory=dict, repr=False, compare=False)
    """Tensors of the saved payloads (an image sample's trajectory), by the keys their JSON names; written
    beside the JSON as ``controller-<k>.safetensors``."""

    def write(self, path: Path) -> None:
        """Write into an unfinished checkpoint folder (no fsync: `finalize` syncs every file before the manifest)."""
        entry = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tensors"}
        if self.tensors:
            # cloned: payloads share tensors (the time grid of every group), which safetensors will not write twice
            save_file({key: value.clone().contiguous() for key, value in self.tensors.items()},
                      str(path.with_suffix(".safetensors")))
        path.write_text(json.dumps(entry) + "\n")

    @classmethod
    def read(cls, path: Path) -> ControllerState:
        """Read a state `write` wrote; CheckpointError naming the file when it is not one."""
        try:
            entry = json.loads(path.read_text())
            for moment in ("before", "after"):  # a checkpoint of gcore-rl before 2026-12: a language job's accuracy
                if f"eval_accuracy_{moment}" in entry:
                    accuracy = entry.pop(f"eval_accuracy_{moment}")
                    entry[f"eval_{moment}"] = {} if accuracy is None else {"eval/accuracy": accuracy}
            state = cls(**entry)
            sidecar = path.with_suffix(".safetensors")
            if sidecar.exists():
                state.tensors = load_file(str(sidecar))
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file '{path}' is missing; resume from another checkpoint "
                                  "(run.resume=PATH) or start fresh") from None
        except (ValueError, TypeError, OSError) as exc:
            raise CheckpointError(f"checkpoint file '{path}' is not a controller state this version of gcore-rl "
                                  f"wrote ({exc}); resume from another checkpoint (run.resume=PATH)") from None
        if state.version != STATE_VERSION:
            raise CheckpointError(f"checkpoint file '{path}' has controller state version {state.version}, this "
                                  f"gcore-rl reads version {STATE_VERSION}")
        return state

    def rollouts_ahead(self) -> list[dict[str, Any]]:
        """The encoded rollouts made ahead of the next steps, in step order (a checkpoint written before
        bounded staleness holds one rollout or None in `ahead`)."""
        if self.ahead is None:
            return []
        return [self.ahead] if isinstance(self.ahead, dict) else list(self.ahead)

    def rollout_loads(self) -> list[RolloutLoad]:
        """The rebalancer's history as it was."""
        return [RolloutLoad.from_dict(load) for load in self.loads]


# ---- saving -----------------------------------------------------------------------------


def _copy_model_files(source: Path, target: Path) -> None:
    """The policy folder's config and tokenizer files (everything but weights) into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix not in {".safetensors", ".bin", ".pt", ".pth"}:
            shutil.copy2(path, target / path.name)


class RunCheckpoints:
    """When and how one controller saves (see the module docstring).

    Args:
        cfg: the job; `run.checkpoint_every`, `run.checkpoint_dir` and `run.keep_checkpoints` apply.
        info: this controller among the K.
        workers: the slice's client (`SliceClient`): its trainers write the tensors.
        trainer_devices: trainer devices of the whole job, for the manifest.
        frozen: the frozen models to record in the manifest, by role (default: a language job's,
            `frozen_model_paths`); a diffusion job (`FlowGrpoJobConfig`, whose `run`, `model.path` and
            `runtime` read as a language job's) passes its own.
    """

    def __init__(self, cfg: JobConfig, info: DistInfo, workers, trainer_devices: int,
                 frozen: dict[str, str] | None = None):
        self.cfg = cfg
        self._frozen_paths = frozen_model_paths(cfg) if frozen is None else frozen
        self.info = info
        self.workers = workers
        self.trainer_devices = trainer_devices
        self.root = checkpoint_root(cfg.run.output_dir, cfg.run.checkpoint_dir)
        self._pending: tuple[int, Path, float] | None = None  # step, folder, seconds the save held the step
        self._complete: tuple[int, Path, float] | None = None  # written everywhere, not yet listed and renamed
        self._finalizing: threading.Thread | None = None
        self._finalize_error: BaseException | None = None
        self._frozen: list[FrozenModel] | None = None
        self._config_yaml = yaml_text(cfg) if info.is_main else ""  # the run's config does not change: dumped once
        self._config_sha256 = config_sha256(to_dict(cfg))
        self.last_save_seconds = 0.0
        self.last_checkpoint_bytes = 0  # the size of the last finished checkpoint (controller 0)
        self._unlisted: tuple[int, Path, float] | None = None  # a complete checkpoint whose listing failed
        self._warned = False

    def due(self, step: int) -> bool:
        """Whether `step` ends with a save."""
        every = self.cfg.run.checkpoint_every
        return every > 0 and step % every == 0

    def save(self, step: int, state: ControllerState) -> float:
        """Start the checkpoint of `step`; returns the seconds it held this controller (staging included)."""
        started = time.perf_counter()
        self.finish(then_saving=True)
        self._warn_if_short_of_room()
        # the previous checkpoint is completed (listed, renamed) by controller 0's thread once this one is
        # staged: its checksums and fsyncs would otherwise compete with this save for the same disk and
        # the interpreter (`prune` keeps unfinished folders newer than the newest finished one)
        folder = step_dir(self.root, step, incomplete=True)
        try:
            self._write(step, folder, state)
        except BaseException:
            # this save failed (a full disk: `DiskError`): its partial folder goes, to give back its space, and
            # the checkpoint before it, complete, is still listed and renamed: the newest `run.resume=auto` takes
            self._discard(folder)
            self._start_finalizer()
            with contextlib.suppress(Exception):
                self._join_finalizer()
            raise
        self._start_finalizer()
        held = time.perf_counter() - started
        self._pending = (step, folder, held)
        self.last_save_seconds = held
        return held

    def _discard(self, folder: Path) -> None:
        """Controller 0: remove the unfinished folder of a save that failed (never a finished checkpoint); then a
        complete checkpoint whose listing failed meanwhile (its manifest met the disk that this save filled) is
        listed again, with the room the removal gave back."""
        if not self.info.is_main:
            return
        if folder.name.endswith(INCOMPLETE_SUFFIX):
            shutil.rmtree(folder, ignore_errors=True)
        if self._finalizing is not None:
            self._finalizing.join()
            self._finalizing = None
        if self._unlisted is not None:
            self._finalize_error = None
            self._finalize(*self._unlisted)

    def _write(self, step: int, folder: Path, state: ControllerState) -> None:
        """Write this controller's part of the checkpoint of `step` into the unfinished `folder` (controller 0:
        the config and the model's files), with the slice's trainers' state."""
        with writing(folder, "the checkpoint"):
            folder.mkdir(parents=True, exist_ok=True)
            if self.info.is_main:
                (folder / CONFIG).write_text(self._config_yaml, encoding="utf-8")
                _copy_model_files(Path(self.cfg.model.path), folder / MODEL_DIR)
        self.workers.save_checkpoint(str(folder))
        with writing(folder, "the checkpoint"):
            maybe_fail("save", step)
            state.write(folder / controller_file(self.info.rank))

    def _warn_if_short_of_room(self) -> None:
        """Controller 0, once per run: say so when the checkpoint folder's disk has less room than the last
        checkpoint took (the save may fail; the run then stops with the disk-full error, nothing lost)."""
        if not self.info.is_main or self._warned or not self.last_checkpoint_bytes:
            return
        free = free_bytes(self.root)
        if free is not None and free < self.last_checkpoint_bytes:
            self._warned = True
            print(f"warning: {free:,} bytes are free under '{self.root}', less than the last checkpoint took "
                  f"({self.last_checkpoint_bytes:,} bytes): this save may fail, and the run would then stop "
                  "with every earlier checkpoint intact", file=sys.stderr, flush=True)

    def finish(self, then_saving: bool = False) -> None:
        """Complete the checkpoint in flight, if any: wait for the trainers, meet the other controllers,
        and (controller 0) list, rename and prune in the background: from here, or, when a save
        follows at once (`then_saving`), from `save` once that save is staged."""
        if self._pending is None:
            return
        self._complete, self._pending = self._pending, None
        try:
            self.workers.finish_checkpoint()  # a background write that failed raises here, at a step boundary
        except BaseException:
            self._discard(self._complete[1])
            self._complete = None
            raise
        barrier()  # every controller's state and every trainer's shards are on disk
        if not then_saving:
            self._start_finalizer()

    def _start_finalizer(self) -> None:
        """Controller 0: list, rename and prune the completed checkpoint (if any) in a thread of its own,
        after the one before it."""
        if self._complete is None or not self.info.is_main:
            self._complete = None
            return
        step, folder, held = self._complete
        self._complete = None
        self._join_finalizer()
        self._finalizing = threading.Thread(target=self._finalize, args=(step, folder, held), daemon=False,
                                            name=f"checkpoint-{step}")
        self._finalizing.start()

    def _finalize(self, step: int, folder: Path, held: float) -> None:
        self._unlisted = (step, folder, held)  # until its manifest is written
        try:
            if self._frozen is None:
                self._frozen = [frozen_model(role, path) for role, path in self._frozen_paths.items()]
            with writing(folder, "the checkpoint's manifest"):
                final = finalize(folder, step=step, config_sha256=self._config_sha256,
                                 controllers=self.info.world_size, trainer_devices=self.trainer_devices,
                                 devices=self.cfg.runtime.devices, frozen=self._frozen, save_seconds=held)
            self._unlisted = None
            self.last_checkpoint_bytes = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
            prune(self.root, self.cfg.run.keep_checkpoints)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the controller's thread by _join_finalizer
            self._finalize_error = exc

    def _join_finalizer(self) -> None:
        if self._finalizing is not None:
            self._finalizing.join()
            self._finalizing = None
        if self._finalize_error is not None:
            error, self._finalize_error = self._finalize_error, None
            raise error

    def salvage(self) -> None:
        """On the way out of a failed run: complete the checkpoint in flight (written while its step ran), so a
        failure in a later phase, an out-of-memory update say, leaves it listed for `run.resume=auto`. Only a
        single controller does this: with several, the others may be gone and the completion waits for them."""
        if self.info.world_size == 1:
            with contextlib.suppress(Exception):
                self.close()

    def close(self) -> None:
        """Complete the checkpoint in flight and wait until it is renamed (end of the run)."""
        self.finish()
        self._start_finalizer()
        self._join_finalizer()
