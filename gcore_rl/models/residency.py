"""Moving a frozen model between its device and host memory, for devices that roles share over time."""

from __future__ import annotations

import torch
from torch import nn


class HostOffload:
    """Mixin for a frozen model (`self.model` on `self.device`) that sleeps in host memory.

    The interface the device worker's time sharing expects of every model it swaps (the same as
    `GenerationEngine`'s): `state` ("awake" or "offloaded"), `sleep(level)` and `wake()`. A frozen
    model never changes, so both sleep levels keep the host copy ("discard" acts as "offload").
    """

    model: nn.Module
    device: torch.device
    state: str = "awake"

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])

    def sleep(self, level: str = "offload") -> int:
        """Move the weights to host memory; returns the bytes released (0 if already asleep)."""
        if self.state != "awake":
            return 0
        released = self.weight_bytes()
        self.model.to("cpu")
        self.state = "offloaded"
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return released

    def wake(self) -> None:
        """Bring the weights back to the device."""
        if self.state != "awake":
            self.model.to(self.device)
            self.state = "awake"
