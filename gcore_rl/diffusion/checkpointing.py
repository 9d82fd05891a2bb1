"""What a diffusion job's controller keeps in a checkpoint besides its trainers' state, and how a resume reads it.

A diffusion job saves and resumes through the language job's machinery (`controller/checkpointing.py`'s
`RunCheckpoints`: the trainers' tensors through DCP in the background, the manifest, the rename, pruning;
`runtime/resume.py`: choosing and checking the checkpoint). Each controller adds `controller-<k>.json`
(`FlowControllerState`): the step, its prompt generator's state, the rewards so far, the held-out
evaluations, the rebalancer's history and split, and, under `disaggregated`, the batch sampled ahead for
the next step with the weights of the update before (`SampledBatch`), whose tensors (the trajectory and
images) go to ``controller-<k>.safetensors`` beside it. Sampling noise and trained steps are functions
of (`run.seed`, step, controller), so nothing else of the random state needs saving. `export_flow_checkpoint`
writes a checkpoint's policy as a diffusers folder (`gcore-rl export`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gcore_rl.checkpoint.export import check_export, check_written, load_policy_weights, unfit
from gcore_rl.checkpoint.layout import CONFIG
from gcore_rl.diffusion.sampler import Trajectory
from gcore_rl.errors import CheckpointError, GcoreError

STATE_VERSION = 1
TRAJECTORY_FIELDS = ("latents", "logprobs", "times", "images")


@dataclass
class SampledBatch:
    """A step's images sampled (and rewarded) before the step that trains on them: the rows (each repeated n
    times), the weights' version they were sampled with, the trajectory, and the rewards found so far (rule
    rewards, accuracies and errors of the chunks, the scoring model's scores)."""

    rows: list[dict]
    version: int
    trajectory: Trajectory
    model_scores: list[float] | None
    rewards: list[float]
    accuracy: list[float]
    errors: int


@dataclass
class FlowControllerState:
    """Everything of one diffusion controller that the step after `step` depends on (see the module docstring).

    `order` is the state of the controller's prompt generator (`torch.Generator.get_state`, as a list of
    bytes); `loads` the rebalancer's history (`RolloutLoad.as_dict`); `ahead` the batch sampled ahead.
    """

    step: int
    controllers: int
    order: list[int]
    rewards: list[float]
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    rollout_devices: int
    loads: list[dict[str, Any]] = field(default_factory=list)
    ahead: SampledBatch | None = None
    version: int = STATE_VERSION

    def write(self, path: Path) -> None:
        """Write into an unfinished checkpoint folder: the JSON at `path` and, with a batch ahead, its tensors
        beside it (no fsync: the checkpoint's finalisation syncs every file before the manifest)."""
        entry = {key: value for key, value in asdict(self).items() if key != "ahead"}
        if self.ahead is not None:
            entry["ahead"] = {key: value for key, value in asdict(self.ahead).items() if key != "trajectory"}
            tensors = {name: getattr(self.ahead.trajectory, name).contiguous() for name in TRAJECTORY_FIELDS}
            save_file(tensors, str(path.with_suffix(".safetensors")))
        path.write_text(json.dumps(entry) + "\n")

    @classmethod
    def read(cls, path: Path) -> FlowControllerState:
        """Read a state `write` wrote; CheckpointError naming the file when it is missing or not one."""
        try:
            entry = json.loads(path.read_text())
            ahead = entry.pop("ahead", None)
            state = cls(**entry)
            if ahead is not None:
                tensors = load_file(str(path.with_suffix(".safetensors")))
                trajectory = Trajectory(**{name: tensors[name] for name in TRAJECTORY_FIELDS})
                state.ahead = SampledBatch(trajectory=trajectory, **ahead)
        except FileNotFoundError as exc:
            raise CheckpointError(f"checkpoint file '{exc.filename or path}' is missing; resume from another checkpoint "
                                  "(run.resume=PATH) or start fresh") from None
        except (ValueError, TypeError, KeyError, OSError) as exc:
            raise CheckpointError(f"checkpoint file '{path}' is not a diffusion controller's state that this version of "
                                  f"gcore-rl wrote ({type(exc).__name__}: {exc}); resume from another checkpoint "
                                  "(run.resume=PATH)") from None
        if state.version != STATE_VERSION:
            raise CheckpointError(f"checkpoint file '{path}' has diffusion controller state version {state.version}, "
                                  f"this gcore-rl reads version {STATE_VERSION}")
        return state

    def generator(self) -> torch.Generator:
        """The prompt generator as it was."""
        generator = torch.Generator()
        generator.set_state(torch.tensor(self.order, dtype=torch.uint8))
        return generator


def export_flow_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a diffusion job's verified checkpoint as a diffusers folder: the trained transformer from the DCP
    folder, every other part (scheduler, text encoders, tokenizers, VAE) copied from the job's start model
    (`model.path` of the checkpoint's config, which the checkpoint refers to rather than copies). Checks and
    errors as `checkpoint.export.export_checkpoint`'s."""
    from gcore_rl.configlib import load_config
    from gcore_rl.diffusion.config import FlowGrpoJobConfig
    from gcore_rl.diffusion.model import load_flow_model
    from gcore_rl.diffusion.sft import save_flow_model

    folder, out = Path(checkpoint), Path(out_dir)
    check_export(folder, out)
    try:
        source = load_config(FlowGrpoJobConfig, folder / CONFIG, []).model.path
        model = load_flow_model(source)
    except GcoreError as exc:
        raise unfit(folder, f"the diffusion model its config names cannot be loaded ({' '.join(str(exc).split())}); "
                            "export reads the parts that are not trained from there") from None
    load_policy_weights(model.transformer, folder)
    save_flow_model(model.transformer, source, out)
    check_written(model.transformer, out / "transformer", folder)
    return out
