"""A real, small checkpoint folder, laid out as a training save writes one (see gcore_rl/checkpoint/layout.py)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import PreTrainedModel

from gcore_rl.checkpoint import layout, stacking
from gcore_rl.checkpoint.manifest import config_sha256, finalize, frozen_model
from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model, write_tiny_model

TINY = TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64)
"""The shape of tests/cli_helpers.TINY_SHAPE: the small model the checkpoint tests save."""
CONFIG = {"run": {"steps": 4}, "model": {"path": "tiny"}}
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def tiny_policy(seed: int = 0) -> PreTrainedModel:
    """The tiny model with weights drawn from `seed` (so each checkpoint holds different weights)."""
    tokenizer = build_char_tokenizer()
    shape = TinyModelConfig(**{**TINY.__dict__, "seed": seed})
    return build_tiny_model(shape, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)


def write_unfinished(root: Path, step: int, model: PreTrainedModel, model_dir: Path) -> Path:
    """``root/step-N.incomplete``: DCP trainer state, the model's config and tokenizer, trainer and controller JSON."""
    folder = layout.step_dir(root, step, incomplete=True)
    folder.mkdir(parents=True)
    entries, stacks = stacking.group({(name, "param"): tensor for name, tensor in model.state_dict().items()})
    state = {"model": {key: torch.stack(tensors) for key, tensors in entries.items()},
             "moments": {"float32_3": torch.zeros(1, 3)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=folder / layout.TRAINER_DIR, no_dist=True)
    (folder / layout.MODEL_DIR).mkdir()
    for name in MODEL_FILES:
        shutil.copy(model_dir / name, folder / layout.MODEL_DIR / name)
    (folder / layout.TRAINER_STATE).write_text(json.dumps({"optimiser_steps": step, "scheduler": {},
                                                              "stacks": {"model": stacks,
                                                                         "moments": {"float32_3": [["dummy", "exp_avg"]]}}}))
    (folder / layout.controller_file(0)).write_text(json.dumps({"step": step}))
    (folder / layout.CONFIG).write_text("run:\n  steps: 4\n")
    return folder


def write_checkpoint(root: Path, step: int, model_dir: Path, seed: int = 0) -> tuple[Path, PreTrainedModel]:
    """A finished checkpoint ``root/step-N`` of a tiny policy drawn from `seed`, and that policy.

    `model_dir` is a tiny model folder (`write_tiny_model`) whose config and tokenizer are copied
    and which is recorded as the frozen reference model.
    """
    model = tiny_policy(seed)
    folder = write_unfinished(root, step, model, model_dir)
    final = finalize(folder, step=step, config_sha256=config_sha256(CONFIG), controllers=1, trainer_devices=1,
                     devices=2, frozen=[frozen_model("reference", model_dir)], save_seconds=0.5)
    return final, model


def tiny_model_dir(root: Path) -> Path:
    """``root/tiny``: the tiny model written in Hugging Face format (the source of config and tokenizer)."""
    return write_tiny_model(root / "tiny", TINY)
