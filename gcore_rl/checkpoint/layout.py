"""Where the parts of a checkpoint live on disk (one place, so writers and readers agree).

A run's checkpoints are folders under `run.checkpoint_dir` (default ``OUTPUT_DIR/checkpoints``)::

    step-00000012/                 a complete checkpoint (renamed from step-00000012.incomplete/)
        manifest.json              step, time, config hash, world sizes, every file with size and sha256,
                                   the frozen models (reference, judge, reward model) by path and checksum
        config.yaml                the resolved job config at the save
        trainer/                   torch.distributed.checkpoint (DCP) folder: the trainer's tensors,
                                   sharded as saved (parameters and AdamW moments, same-shaped ones stacked
                                   into one entry: checkpoint/stacking.py)
        model/                     the policy's config.json and tokenizer files (no weights), for export
        trainer.json               the trainer's non-tensor state (scheduler, optimiser steps, param groups,
                                   AdamW step counts, which tensor is where in the stacks)
        critic/, critic.json       the same for PPO's critic when it trained on devices of its own
                                   (placement.critic_devices > 0); otherwise it is inside trainer/
        controller-<k>.json        controller k's state: step, sampler position, dynamic-sampling EMA and
                                   buffered groups, rebalancer history, batches in flight
    step-00000016.incomplete/      a save still being written, or one a crash interrupted (never loaded)

Nothing in a checkpoint is unpickled except DCP's own `.metadata`, and that only after its checksum
matched the manifest and a restricted unpickler accepted it.
"""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_VERSION = 3  # 2: AdamW moments stacked per parameter, step counts in trainer.json; 3: tensors stacked by shape
MANIFEST = "manifest.json"
CONFIG = "config.yaml"
TRAINER_DIR = "trainer"
TRAINER_STATE = "trainer.json"
CRITIC_DIR = "critic"
CRITIC_STATE = "critic.json"
DCP_DIRS = (TRAINER_DIR, CRITIC_DIR)
"""The DCP folders a checkpoint may have: the trainer's, and the critic's when it trained apart from the actor."""
INCOMPLETE_SUFFIX = ".incomplete"
_STEP_DIR = re.compile(r"^step-(\d{8})(\.incomplete)?$")


def checkpoint_root(output_dir: str | Path, checkpoint_dir: str | None) -> Path:
    """The folder that holds a run's checkpoints: `checkpoint_dir`, or ``OUTPUT_DIR/checkpoints``."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(output_dir) / "checkpoints"


def step_dir(root: str | Path, step: int, incomplete: bool = False) -> Path:
    """``ROOT/step-%08d`` (with the ``.incomplete`` suffix while it is written)."""
    return Path(root) / (f"step-{step:08d}" + (INCOMPLETE_SUFFIX if incomplete else ""))


def parse_step_dir(path: str | Path) -> tuple[int, bool] | None:
    """(step, complete) of a checkpoint folder's name, or None when the name is not one."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2) is None


def controller_file(rank: int) -> str:
    """File name of controller `rank`'s state inside a checkpoint folder."""
    return f"controller-{rank}.json"

MODEL_DIR = "model"
"""Sub-folder with the policy's `config.json`, generation config and tokenizer files (not its weights),
so `gcore-rl export` rebuilds the model from the checkpoint alone."""
