"""Host-to-device copies that leave the host free: an upload from pageable host memory first waits for the
device's queued work (CUDA synchronises the stream before such a copy), one through pinned memory is queued
behind it and returns at once. The engines' loops upload this way so that they never wait on a GPU between
their counted reads (issue 49)."""

from __future__ import annotations

import torch


def upload(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` on `device`: a host tensor as it is, a list as a long tensor; to a GPU through pinned memory,
    asynchronously (the pinned copy stays alive until the device has read it: PyTorch's host allocator tracks it)."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
