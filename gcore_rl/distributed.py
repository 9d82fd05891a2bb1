"""Process groups and the small collectives every layer uses (controllers, trainers, runtimes).

The ground floor: it imports nothing from the package, so any layer may import it."""

from __future__ import annotations

import os
import socket
from collections.abc import Collection
from contextlib import closing
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the trainer group."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """Return a TCP port on the loopback interface that is free right now."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' → the local CUDA device when present, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_process_group(rank: int, world_size: int, master_port: int, device: torch.device,
                       master_addr: str = "127.0.0.1") -> DistInfo:
    """Join the trainer group (gloo on CPU, NCCL on CUDA) at rank 0's address; a group of one is fine."""
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return DistInfo(rank=rank, world_size=world_size, device=device)


def barrier() -> None:
    """Wait for every member of the group (no-op without a group of several)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


_TEARDOWN = True  # False in a process that ends by `os._exit` (`exit_without_teardown`)


def exit_without_teardown() -> None:
    """Mark this process as one that ends by `os._exit` when its work is done (a spawned controller,
    `runtime/spawn.py`): `destroy_process_group` then leaves the group to the process's end. gloo's C++
    teardown occasionally aborts the process ("terminate called without an active exception", SIGABRT)
    after every step has finished and every file is written, which made a finished run fail; a
    process that exits without running it cannot."""
    global _TEARDOWN
    _TEARDOWN = False


def destroy_process_group() -> None:
    """Tear the default process group down (not in a process marked by `exit_without_teardown`)."""
    if dist.is_initialized() and _TEARDOWN:
        dist.destroy_process_group()



def all_reduce_mean(values: dict[str, float], device: torch.device, sum_keys: Collection[str] = ()) -> dict[str, float]:
    """Reduce scalar metrics over the group: maxima (keys ending in `max`) by max, `sum_keys` by sum, the rest by mean.

    Identity for a group of one.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or not values:
        return dict(values)
    keys = sorted(values)
    max_keys = [k for k in keys if k.endswith("max")]
    summed = [k for k in keys if k in sum_keys and k not in max_keys]
    mean_keys = [k for k in keys if k not in max_keys and k not in summed]
    reduced: dict[str, float] = {}
    for group, op, scale in ((mean_keys, dist.ReduceOp.SUM, 1.0 / dist.get_world_size()),
                             (summed, dist.ReduceOp.SUM, 1.0), (max_keys, dist.ReduceOp.MAX, 1.0)):
        if not group:
            continue
        tensor = torch.tensor([float(values[k]) for k in group], dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=op)
        reduced.update(zip(group, (tensor * scale).tolist(), strict=True))
    return reduced
