"""The driver's side of resuming: choose and check the checkpoint, and rewind the run's records to it.

`run.resume=auto` takes the newest complete checkpoint under the run's checkpoint folder that
verifies (sizes, checksums, DCP metadata), falling back to older ones with a line saying why each
newer one was skipped, and starts fresh, saying so, when there is none. `run.resume=PATH` takes that
checkpoint or fails. Either way the checkpoint's config must agree with the job's on everything
that shapes the model, the data and the algorithm (`FIXED_KEYS`); the runtime, the placement, the
step count and the outputs may change. The records of steps after the checkpoint (metrics, prompt
rows, timelines) are removed from the run folder, so they are written once more by the resumed run.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gcore_rl.checkpoint.layout import CONFIG, MANIFEST, checkpoint_root, parse_step_dir
from gcore_rl.checkpoint.manifest import frozen_model, newest_valid, read_manifest, verify
from gcore_rl.config import frozen_model_paths, load_job_config
from gcore_rl.configlib import to_dict
from gcore_rl.errors import CheckpointError, ConfigError, GcoreError

FIXED_KEYS = ("model", "reference_path", "algo", "train", "critic", "sampling", "data", "reward", "dynamic_sampling", "judge",
              "reward_model", "run.seed", "run.prompts_per_step")
"""Config keys (sections or single keys) a resumed job must share with its checkpoint."""

RECORDS = ("metrics.jsonl", "prompts/*.jsonl", "lengths/*.jsonl", "timeline/*.jsonl", "samples.jsonl")
"""Per-step JSON-lines records of a run folder (each line has a ``step``)."""


@dataclass(frozen=True)
class JobKind:
    """How to compare a job with the job that saved a checkpoint: read the saved config, the keys that must
    agree, and the job's frozen models by role (a language job's by default; `runtime.kinds.FLOW.resume` for
    diffusion jobs)."""

    load: Callable[[Path], Any] = load_job_config
    fixed_keys: tuple[str, ...] = FIXED_KEYS
    frozen: Callable[[Any], dict[str, str]] = frozen_model_paths


def take_up(cfg: Any, kind: JobKind = JobKind(), say: Callable[[str], None] = print) -> Any:
    """Prepare the run folder of a job that starts (`cfg`): with `run.resume`, `resolve_resume`, then remove the
    records of steps after the checkpoint and set later checkpoints aside; without it, refuse a folder that
    already holds a run (ConfigError), so earlier results are never overwritten. Returns `resolve_resume`'s cfg."""
    out = Path(cfg.run.output_dir)
    continuing = cfg.run.resume is not None
    cfg = resolve_resume(cfg, say, kind)
    if continuing:
        # starting fresh keeps no record, not even a diffusion job's step-0 evaluation
        step = checkpoint_step(cfg.run.resume) if cfg.run.resume else -1
        rewind_run_dir(out, step)
        set_aside_newer_checkpoints(checkpoint_root(out, cfg.run.checkpoint_dir), step, say)
    elif (out / "metrics.jsonl").exists():
        raise ConfigError("run.output_dir", f"'{out}' already holds a run (metrics.jsonl); choose a new "
                          "run.output_dir, remove the old one, or continue it with run.resume=auto, so earlier "
                          "results are never overwritten")
    return cfg


def resolve_resume(cfg: Any, say: Callable[[str], None] = print, kind: JobKind = JobKind()) -> Any:
    """`cfg` with `run.resume` replaced by the checked checkpoint folder to resume from, or None.

    Raises CheckpointError when `run.resume` names a folder that is not a usable checkpoint, and
    ConfigError when the checkpoint's job differs from `cfg` in a key of `kind.fixed_keys`.
    """
    if not cfg.run.resume:
        return cfg
    if cfg.run.resume == "auto":
        root = checkpoint_root(cfg.run.output_dir, cfg.run.checkpoint_dir)
        folder, skipped = newest_valid(root) if root.is_dir() else (None, [])
        for reason in skipped:
            say(f"resume: skipped {reason}")
        if folder is None:
            say(f"resume: no complete checkpoint in '{root}'; starting fresh")
            return _with_resume(cfg, None)
    else:
        folder = Path(cfg.run.resume)
        if not folder.is_dir() or parse_step_dir(folder) is None:
            raise CheckpointError(f"run.resume='{folder}' is not a checkpoint folder (step-NNNNNNNN under a run's "
                                  "checkpoints/); list a run's checkpoints with `gcore-rl checkpoints RUN_DIR`")
        verify(folder)
    check_compatible(cfg, folder, kind)
    say(f"resume: continuing from '{folder}'")
    return _with_resume(cfg, str(folder.resolve()))


def _with_resume(cfg: Any, folder: str | None) -> Any:
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=folder))


def check_compatible(cfg: Any, folder: Path, kind: JobKind = JobKind()) -> None:
    """ConfigError naming every `kind.fixed_keys` key whose value differs between `cfg` and the checkpoint's config."""
    try:
        saved = kind.load(folder / CONFIG)
    except GcoreError as exc:
        raise CheckpointError(f"the config of checkpoint '{folder}' ({folder / CONFIG}) cannot be read: {exc}") from None
    _check_frozen_models(kind.frozen(cfg), folder)
    _check_critic_placement(cfg, saved, folder)
    now, then = dict(_flatten(to_dict(cfg))), dict(_flatten(to_dict(saved)))
    differing = [key for key in sorted(now.keys() | then.keys())
                 if any(key == fixed or key.startswith(fixed + ".") for fixed in kind.fixed_keys)
                 and now.get(key) != then.get(key)]
    if differing:
        changes = "; ".join(f"{key} was {then.get(key)!r}, now {now.get(key)!r}" for key in differing)
        raise ConfigError("run.resume", f"the job differs from the one that saved '{folder}' in what shapes the model, "
                          f"data or algorithm: {changes}. Resume with the saved values ({folder / CONFIG}), or "
                          "start a new run")


def _check_critic_placement(cfg: Any, saved: Any, folder: Path) -> None:
    """ConfigError when PPO's critic was saved on devices of its own (`placement.critic_devices` > 0 in the
    saved config) and the job puts it with the actor, or the other way round: the two keep the critic's
    state in different places (critic/ or inside trainer/). Jobs without a critic on both sides pass (a
    change of algorithm is the fixed keys' to report)."""
    def critic_apart(job: Any) -> bool | None:
        if not getattr(getattr(job, "algo", None), "uses_critic", False):
            return None
        return getattr(getattr(job, "placement", None), "critic_devices", 0) > 0

    apart, saved_apart = critic_apart(cfg), critic_apart(saved)
    if apart is None or saved_apart is None or apart == saved_apart:
        return
    where = {True: "on devices of its own (placement.critic_devices > 0)",
             False: "with the actor (placement.critic_devices=0)"}
    raise ConfigError("placement.critic_devices", f"checkpoint '{folder}' saved the critic {where[saved_apart]}, "
                      f"and this job puts it {where[apart]}; the critic's state is kept in different places "
                      "(critic/ or inside trainer/), so resume with a critic_devices on the same side of 0, or "
                      "start a new run")


def _check_frozen_models(paths: dict[str, str], folder: Path) -> None:
    """CheckpointError when a frozen model (reference, judge, reward model; `paths` by role) the checkpoint
    recorded has other weights now than at the save (checksums of its weight files)."""
    for saved in read_manifest(folder).frozen:
        if saved.role in paths and frozen_model(saved.role, paths[saved.role]).sha256 != saved.sha256:
            raise CheckpointError(f"the {saved.role} model at '{paths[saved.role]}' has other weights than when "
                                  f"'{folder}' was saved (its checksum differs from {folder / MANIFEST}); the "
                                  "reward and KL terms would change under the run: resume with the model it was "
                                  "saved with, or start a new run")


def _flatten(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def checkpoint_step(folder: str | Path) -> int:
    """The step a checkpoint folder was saved after."""
    parsed = parse_step_dir(folder)
    if parsed is None:
        raise CheckpointError(f"'{folder}' is not a checkpoint folder")
    return parsed[0]


def set_aside_newer_checkpoints(root: Path, step: int, say: Callable[[str], None] = print) -> None:
    """Make room for the resumed run's saves: delete unfinished saves after `step` (their writer is gone) and
    rename finished ones after it (damaged, or of a timeline the resume branches from) to
    ``step-N.abandoned-<time>``, which no listing or resume takes for a checkpoint."""
    if not root.is_dir():
        return
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    for folder in sorted(root.iterdir()):
        parsed = parse_step_dir(folder)
        if parsed is None or parsed[0] <= step:
            continue
        if parsed[1]:
            target = folder.with_name(f"{folder.name}.abandoned-{stamp}")
            folder.rename(target)
            say(f"resume: set aside '{folder}' (after the step resumed from) as '{target.name}'")
        else:
            shutil.rmtree(folder)


def rewind_run_dir(output_dir: str | Path, step: int) -> None:
    """Remove every record line of a step after `step` from the run folder's per-step records."""
    out = Path(output_dir)
    for pattern in RECORDS:
        for path in sorted(out.glob(pattern)):
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if line.strip() and _line_step(line) <= step]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept))
            tmp.replace(path)


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 1 << 62  # a torn last line of a killed run is no step's record: dropped with the later steps
