"""Export a checkpoint's policy as a Hugging Face model folder (`gcore-rl export CHECKPOINT OUT_DIR`).

The checkpoint is verified first (files, sizes, checksums, DCP metadata under the restricted
unpickler). The model is rebuilt from ``CHECKPOINT/model/config.json``, its weights are read from
the DCP folder ``CHECKPOINT/trainer`` (only the ``model`` entries, never the optimiser state, unstacked
by the layout in ``trainer.json``: `checkpoint.stacking`), and
the folder is written with the tokenizer from ``CHECKPOINT/model``. The written weights are read back and
compared with the loaded ones before the export counts as done. A diffusion job's checkpoint goes through the
same checks and weight loading (`diffusion.checkpointing.export_flow_checkpoint`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from gcore_rl.checkpoint import layout, stacking
from gcore_rl.checkpoint.manifest import read_dcp_metadata, verify
from gcore_rl.errors import CheckpointError, ConfigError
from gcore_rl.models.loading import LOAD_ERRORS, save_model_dir

MODEL_KEY = "model"
"""Top-level key of the policy's parameters in the checkpoint's DCP state dict (beside ``optimizer``)."""


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the policy of a verified checkpoint to `out_dir` as a Hugging Face folder and return it.

    Refuses an `out_dir` that already holds a model (ConfigError), and a checkpoint that does not
    verify or whose weights do not fit its model config (CheckpointError). A diffusion job's checkpoint
    (`is_diffusion_checkpoint`) is exported by `diffusion.checkpointing.export_flow_checkpoint`.
    """
    folder, out = Path(checkpoint), Path(out_dir)
    check_export(folder, out)
    model = _model_from_config(folder)
    load_policy_weights(model, folder)
    save_model_dir(model, saved_tokenizer(folder), out)
    check_written(model, out, folder)
    return out


def check_export(folder: Path, out: Path) -> None:
    """ConfigError when `out` already holds a model; the checkpoint `folder` verified (CheckpointError otherwise)."""
    for marker in ("config.json", "model_index.json"):
        if (out / marker).exists():
            raise ConfigError("OUT_DIR", f"'{out}' already holds a model ({marker}); choose a new directory or "
                              "remove the old one, so a trained model is never overwritten")
    verify(folder)


def is_diffusion_checkpoint(folder: str | Path) -> bool:
    """Whether a checkpoint was saved by a diffusion job (its ``model/`` holds a pipeline's ``model_index.json``)."""
    return (Path(folder) / layout.MODEL_DIR / "model_index.json").is_file()


def unfit(folder: Path, what: str) -> CheckpointError:
    """A CheckpointError of one paragraph about a checkpoint that verifies but cannot be exported."""
    return CheckpointError(f"cannot export checkpoint '{folder}': {what}; export an earlier checkpoint "
                           f"(`gcore-rl checkpoints {folder.parent}` lists them)")


def _dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype config.json names (``dtype`` or the older ``torch_dtype``), float32 when it names none."""
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, torch.dtype):
        return named
    found = getattr(torch, named, None) if isinstance(named, str) else None
    return found if isinstance(found, torch.dtype) else torch.float32


def _model_from_config(folder: Path) -> PreTrainedModel:
    """The policy's architecture from ``model/config.json`` (random weights, to be overwritten), with its generation config."""
    model_dir = folder / layout.MODEL_DIR
    if not (model_dir / "config.json").is_file():
        raise unfit(folder, f"it has no '{model_dir / 'config.json'}', which export builds the model from")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=_dtype(config))
    except LOAD_ERRORS as exc:
        raise unfit(folder, f"'{model_dir / 'config.json'}' does not describe a causal LM "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())})") from exc
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    return model


def saved_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``model/``, as written (no padding side or pad token imposed)."""
    model_dir = folder / layout.MODEL_DIR
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the tokenizer libraries raise many types (even bare Exception) for bad files
        raise unfit(folder, f"no tokenizer loads from '{model_dir}' ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())})") from exc


def _shares_storage(tensor: torch.Tensor, others: dict[str, torch.Tensor]) -> bool:
    """Whether `tensor` is stored in the same memory as one of `others` (a tied weight such as ``lm_head``)."""
    pointer = tensor.untyped_storage().data_ptr()
    return any(other.untyped_storage().data_ptr() == pointer for other in others.values())


def _saved_weights(folder: Path) -> tuple[dict[str, Any], dict[str, tuple[str, int]]]:
    """The policy's stacked entries of a checkpoint (their DCP metadata, with shape ``(members, *shape)``) and
    where each parameter lives in them: ({entry key: metadata}, {name: (entry key, index)})."""
    try:
        stacks = json.loads((folder / layout.TRAINER_STATE).read_text())["stacks"][MODEL_KEY]
        where = {name: found for (name, _), found in stacking.members_by_name(stacks).items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise unfit(folder, f"'{folder / layout.TRAINER_STATE}' does not say how the weights are stacked "
                             f"({type(exc).__name__}: {exc})") from exc
    metadata = read_dcp_metadata(folder).state_dict_metadata
    entries = {}
    for key in stacks:
        entry = metadata.get(f"{MODEL_KEY}.{key}")
        if entry is None or not hasattr(entry, "size"):
            raise unfit(folder, f"'{folder / layout.TRAINER_DIR}' has no tensor {MODEL_KEY}.{key}, which "
                                 f"'{folder / layout.TRAINER_STATE}' names")
        entries[key] = entry
    return entries, where


def load_policy_weights(model: torch.nn.Module, folder: Path, target: dict[str, torch.Tensor] | None = None) -> None:
    """Copy the checkpoint's policy tensors into `model` (DCP reshards whatever layout was saved): into
    `target` (by name; default every tensor of `model.state_dict()`), which the checkpoint must fill exactly."""
    import torch.distributed.checkpoint as dcp

    entries, where = _saved_weights(folder)
    shapes = {name: tuple(entries[key].size)[1:] for name, (key, _) in where.items()}
    target = model.state_dict() if target is None else target
    wanted = {name: tensor for name, tensor in target.items() if name in shapes}
    missing = [name for name, tensor in target.items() if name not in shapes and not _shares_storage(tensor, wanted)]
    extra = sorted(set(shapes) - set(target))
    wrong = [f"{name} {tuple(shapes[name])} vs {tuple(tensor.shape)}" for name, tensor in wanted.items()
             if tuple(shapes[name]) != tuple(tensor.shape)]
    if missing or extra or wrong:
        parts = [f"the model config needs {_few(missing)}, which the trainer state lacks" if missing else "",
                 f"the trainer state holds {_few(extra)}, which the model config has no place for" if extra else "",
                 f"shapes differ (saved vs config): {_few(wrong)}" if wrong else ""]
        raise unfit(folder, f"'{folder / layout.TRAINER_DIR}' does not fit '{folder / layout.MODEL_DIR}/config.json': "
                             + "; ".join(part for part in parts if part))
    members: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in wanted.items():
        key, index = where[name]
        members.setdefault(key, []).append((index, tensor))
    for key, targets in members.items():  # one stack at a time: host memory for one entry beside the model
        stack = torch.empty(entries[key].size, dtype=entries[key].properties.dtype)
        try:
            with warnings.catch_warnings():  # no_dist=True is the intent: one process reads the whole state
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({MODEL_KEY: {key: stack}}, checkpoint_id=str(folder / layout.TRAINER_DIR), no_dist=True)
        except Exception as exc:  # noqa: BLE001 - DCP wraps every reader failure in CheckpointException (an Exception)
            raise unfit(folder, f"reading the weights from '{folder / layout.TRAINER_DIR}' failed "
                                 f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})") from exc
        with torch.no_grad():
            for index, tensor in targets:
                tensor.copy_(stack[index])


def _few(names: list[str]) -> str:
    """Up to five names, and how many more there are."""
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _written_tensors(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the safetensors files of `out`, by name."""
    tensors: dict[str, Any] = {}
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def check_written(model: torch.nn.Module, out: Path, folder: Path) -> None:
    """The exported files hold exactly the weights loaded from the checkpoint (tied copies may be left out)."""
    written = _written_tensors(out)
    state = model.state_dict()
    differing = [name for name, tensor in written.items() if name not in state or not torch.equal(tensor, state[name])]
    absent = [name for name, tensor in state.items() if name not in written
              and not _shares_storage(tensor, {key: state[key] for key in written if key in state})]
    if differing or absent:
        raise CheckpointError(f"the export of '{folder}' to '{out}' did not write the weights it loaded "
                              f"(differing: {_few(differing) or 'none'}; missing: {_few(absent) or 'none'}); "
                              "remove the folder and export again, on a disk with room for the model")
