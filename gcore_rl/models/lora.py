"""LoRA policies through `peft`: the settings (`model.lora.*`), wrapping a loaded model, and the
views of a wrapped model the rest of the trainer needs.

A LoRA policy is the frozen base model plus low-rank adapters `A` (`[r, in]`) and `B` (`[out, r]`)
on the target linear layers, each adding `scale · B A x` to the layer's output (`scale = alpha / r`,
`B = 0` at the start, so step 0 is the base model). Only the adapters train and only they (with their
AdamW moments) go into checkpoints; the base is a frozen model the checkpoint refers to by checksum.
The reference of the KL is the same model with its adapters switched off (`adapters_disabled`), not a
second copy. The rollout engines hold a plain model: the trainer sends them merged weights
(`merged_weights`: `W + scale · B A` under the base model's own parameter names).

Parameter names inside the wrapped model are peft's (``base_model.model.<name>`` with ``.base_layer``
before a wrapped layer's own parameters, ``.lora_A.default.weight`` for the adapters); `base_name`
maps them back.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from gcore_rl.errors import ConfigError

ADAPTER = "default"
"""The name peft gives the one adapter a policy has."""
PREFIX = "base_model.model."
"""What peft puts before the base model's parameter names."""
CRITIC_HEAD = ("score",)
"""The value head of a critic (`models.value`): it trains whole beside the adapters of a LoRA critic."""
ALL_LINEAR = "all-linear"
"""peft's shorthand for every linear layer but the output head."""


@dataclass
class LoraSettings:
    """Low-rank adapters on the policy (`peft`): only they train, the base stays frozen."""

    enabled: bool = field(default=False, metadata={
        "help": "Train LoRA adapters instead of every parameter: checkpoints hold the adapters and their optimiser "
                "state, the KL's reference is the base model (adapters off), and the engines get merged weights."})
    rank: int = field(default=16, metadata={"help": "Rank r of each adapter (A is r x in, B is out x r)."})
    alpha: float = field(default=32.0, metadata={"help": "Adapter scale numerator: the update is (alpha / rank) * B A."})
    dropout: float = field(default=0.0, metadata={
        "help": "Dropout on the adapters' input in training passes (0 keeps the trainer's log-probs equal to the "
                "engine's)."})
    sync: Literal["merged", "adapters"] = field(default="merged", metadata={
        "help": "What the weight sync sends the engines: 'merged' weights (W + scale * B A, every tensor of the "
                "model) or the 'adapters' alone, which the builtin engine applies itself (its base stays loaded, "
                "so under colocate it sleeps with a host copy instead of dropping its weights)."})
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR], metadata={
        "help": "Module names (or name suffixes) that get adapters, e.g. [q_proj, v_proj]; 'all-linear' is every "
                "linear layer but the output head."})

    def validate(self) -> None:
        if not self.enabled:
            return
        if self.rank < 1:
            raise ConfigError("rank", f"must be at least 1 when LoRA is on, got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError("alpha", f"must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(isinstance(name, str) and name for name in self.target_modules):
            raise ConfigError("target_modules", f"must name at least one module, got {self.target_modules}")

    def peft_config(self, trained: tuple[str, ...] = ()):
        """The `peft.LoraConfig` of these settings; `trained`: modules that train whole, beside the adapters."""
        from peft import LoraConfig

        targets = ALL_LINEAR if self.target_modules == [ALL_LINEAR] else list(self.target_modules)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          bias="none", modules_to_save=list(trained) or None,
                          exclude_modules=list(trained) or None)


def apply_lora(model: nn.Module, settings: LoraSettings, trained: tuple[str, ...] = (),
               key: str = "model.lora.target_modules") -> nn.Module:
    """`model` wrapped by peft with fresh adapters (the base frozen, the modules named in `trained` training
    whole, e.g. a critic's value head); ConfigError naming `key` when the targets match no module."""
    from peft import get_peft_model
    from peft.utils.error import NoMatchingPeftModuleError

    try:
        return get_peft_model(model, settings.peft_config(trained))
    except NoMatchingPeftModuleError as exc:
        raise ConfigError(key, f"{settings.target_modules} match no module of the model "
                          f"({type(model).__name__}; {' '.join(str(exc).split())}); name its linear layers, e.g. "
                          "q_proj or down_proj, or use 'all-linear'") from None


def inject_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Put fresh adapters into `model` in place (B = 0: it computes as before), without peft's wrapper: an
    engine's model that applies the adapters a trainer sends (`sync_weights`), under the names
    `<module>.lora_A.default.weight`."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(settings.peft_config(), model)
    return model


def sync_weights(model: nn.Module, gather: Callable[[torch.Tensor], torch.Tensor], settings: LoraSettings
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """What a LoRA trainer sends the engines (`settings.sync`): the merged weights (`merged_weights`), or the
    adapters alone under the names an engine with injected adapters (`inject_lora`) has for them."""
    if settings.sync == "merged":
        yield from merged_weights(model, gather)
        return
    for name, tensor in adapter_weights(model, gather):
        yield name.removeprefix(PREFIX), tensor


def check_lora_targets(model_dir: str | Path, settings: LoraSettings, critic: bool = False) -> None:
    """ConfigError (`apply_lora`'s) before any process starts when `settings.target_modules` match no module of
    the model in `model_dir` (`critic`: the value model built from it, `critic.lora`); the model is built on the
    meta device, so no weight is read."""
    if not settings.enabled:
        return
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    auto = AutoModelForImageTextToText if isinstance(raw.get("vision_config"), dict) else AutoModelForCausalLM
    if critic:
        config.num_labels, auto = 1, AutoModelForTokenClassification
    with torch.device("meta"):
        model = auto.from_config(config)
        apply_lora(model, settings, CRITIC_HEAD if critic else (),
                   "critic.lora.target_modules" if critic else "model.lora.target_modules")


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is a peft-wrapped policy."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapters_disabled(model: nn.Module) -> contextlib.AbstractContextManager:
    """Within it, a LoRA `model` computes as its base model (the KL's reference); any other model as itself."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name of a wrapped model is an adapter's (`lora_A` / `lora_B`)."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The base model's name of a wrapped model's (non-adapter) parameter."""
    name = name.removeprefix(PREFIX)
    return name.replace(".base_layer.", ".")


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The wrapped layers of a LoRA `model` by module name (each holds `base_layer`, `lora_A`, `lora_B`, `scaling`)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def merged_weights(model: nn.Module, gather: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The LoRA `model`'s weights as its base model names them, the adapters merged in: `(name, tensor)`
    one at a time, where a wrapped layer's weight is `W + scale · B A` (`[out, in]`) and every other
    parameter is the base's. `gather` makes a full tensor of a (possibly sharded) parameter: a collective
    under FSDP, so every rank drains the iterator."""
    layers = lora_layers(model)
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            continue
        tensor = gather(param.detach())
        owner, found, leaf = name.rpartition(".base_layer.")
        if found and leaf == "weight" and owner in layers:
            tensor = tensor + adapter_delta(layers[owner], gather).to(tensor.dtype)
        yield base_name(name), tensor


def adapter_delta(layer: nn.Module, gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`scale · B A` of one wrapped layer (`[out, in]`, fp32), transposed for a layer that stores `[in, out]`."""
    down = gather(layer.lora_A[ADAPTER].weight.detach()).float()
    up = gather(layer.lora_B[ADAPTER].weight.detach()).float()
    delta = (up @ down) * layer.scaling[ADAPTER]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def adapter_weights(model: nn.Module, gather: Callable[[torch.Tensor], torch.Tensor]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters of a LoRA `model` alone: `(name, full tensor)` under the wrapped model's names."""
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            yield name, gather(param.detach())

