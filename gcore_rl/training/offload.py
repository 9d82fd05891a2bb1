"""Trainer offload (`train.offload`): a trainer's state leaves its device while the device's other roles
(the rollout engine, the judge, the reference of `interleave`) use it, and comes back for the update.

- ``optimizer``: the AdamW moments (two fp32 tensors per trained parameter: twice the weights' bytes in
  fp32) go to host memory.
- ``all``: the parameters too (FSDP2's sharded parameters: `module.to`, which FSDP2 re-registers), and
  a sharded reference beside the actor.

Gradients need no move: the optimiser step leaves them unset (`zero_grad(set_to_none=True)`). On CUDA the
host copies are pinned, so the copies back run at full bandwidth. On a CPU device host and device are the
same memory and nothing is freed; `copy=True` still moves every tensor into fresh storage, so the CPU tests
run the same moves, and check that training goes on exactly as without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

OffloadLevel = Literal["none", "optimizer", "all"]
HOST = torch.device("cpu")


@dataclass
class OffloadPart:
    """One model a trainer holds, with its optimiser (None for a frozen model such as the reference)."""

    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None = None


class TrainerOffload:
    """Moves a trainer's `parts` to host memory (`offload`) and back to `device` (`reload`) at `level`.

    Both are idempotent: offloading an offloaded trainer or reloading a resident one does nothing.
    """

    def __init__(self, level: OffloadLevel, device: torch.device, copy: bool = False):
        self.level = level
        self.device = torch.device(device)
        self.copy = copy
        self.offloaded = False

    def offload(self, parts: Sequence[OffloadPart]) -> int:
        """Move the state of `level` to host memory; returns the bytes moved (0 when there was nothing to do)."""
        if self.level == "none" or self.offloaded:
            return 0
        self.offloaded = True
        return self._move(parts, HOST)

    def reload(self, parts: Sequence[OffloadPart]) -> int:
        """Move the offloaded state back to the device; returns the bytes moved."""
        if not self.offloaded:
            return 0
        self.offloaded = False
        return self._move(parts, self.device)

    @torch.no_grad()
    def _move(self, parts: Sequence[OffloadPart], target: torch.device) -> int:
        moved = 0
        for part in parts:
            if part.optimizer is not None:
                moved += move_optimizer_state(part.optimizer, target, self.copy)
            if self.level == "all" and part.model is not None:
                moved += move_module(part.model, target, self.copy)
        if target.type == "cpu" and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return moved


def moved(tensor: torch.Tensor, target: torch.device, copy: bool) -> torch.Tensor:
    """`tensor` on `target`: pinned host memory when it leaves a CUDA device; fresh storage with `copy` even
    when it is already there. A sharded (DTensor) tensor moves its local shard and keeps its mesh and layout."""
    if isinstance(tensor, DTensor):
        return DTensor.from_local(moved(tensor._local_tensor, target, copy), tensor.device_mesh, tensor.placements,
                                  run_check=False, shape=tensor.shape, stride=tensor.stride())
    if target.type == "cpu" and tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST, pin_memory=True)
        return host.copy_(tensor)
    if tensor.device == target and copy:
        return tensor.clone()
    return tensor.to(target)


def move_optimizer_state(optimizer: torch.optim.Optimizer, target: torch.device, copy: bool = False) -> int:
    """Move every tensor of the optimiser's per-parameter state to `target` (AdamW's `exp_avg`, `exp_avg_sq`;
    its `step` counters stay where they are: torch keeps them on the host); returns the bytes moved."""
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = moved(value, target, copy)
                total += local(value).numel() * local(value).element_size()
    return total


def move_module(model: nn.Module, target: torch.device, copy: bool = False) -> int:
    """Move a (FSDP2-sharded) model's parameters and buffers to `target`; returns this rank's bytes moved."""
    total = sum(local(t).numel() * local(t).element_size() for t in [*model.parameters(), *model.buffers()])
    model._apply(lambda tensor: moved(tensor, target, copy))  # FSDP2's `_apply` re-registers its shards
    return total


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded, DTensor) tensor."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
