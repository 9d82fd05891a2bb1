"""FSDP2 wrapping of a model, applied from outside the model code."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def shard_model(model: nn.Module, bf16: bool = False, activation_checkpointing: bool = False) -> nn.Module:
    """Apply FSDP2 `fully_shard` to every transformer block, then to the root module.

    Block classes are the model's `_no_split_modules` (how transformers names its layers).
    With `bf16`, parameters are all-gathered in bf16 and gradients reduced in fp32. With
    `activation_checkpointing`, each block keeps only its input for the backward and recomputes
    its activations there (transformers' activation checkpointing: PyTorch's non-reentrant
    `torch.utils.checkpoint` around every decoder layer's `forward`, in training mode), so activation
    memory is one block's instead of all blocks'. The FSDP hooks stay outside the checkpoint: the
    recompute runs inside the block's backward, while its parameters are gathered for it. Parameter
    names do not change (no wrapper module).
    """
    if activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"train.activation_checkpointing: {type(model).__name__} does not support activation "
                             "checkpointing")
        model.activation_checkpointing_enable({"use_reentrant": False})
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP module of `model`, so that its next forward gathers the
    sharded parameters anew. Needed after the sharded parameters change in place outside an optimiser step:
    the root module keeps its parameters gathered after a forward without a backward, and would otherwise
    run its next forward on the old values."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
