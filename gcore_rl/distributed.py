"""Process groups and the small collectives every layer uses (controllers, trainers, runtimes).

The ground floor: it imports nothing from the package, so any layer may import it."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Collection
from contextlib import closing
from dataclasses import dataclass
from typing import NoReturn

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


_TEARDOWN = True  # False in a process that ends by `end_process` or is killed (`exit_without_teardown`)


def exit_without_teardown() -> None:
    """Mark this process as one that never tears its process groups down: it ends by `end_process` (a
    spawned controller, `runtime/spawn.py`; a rank of a test group) or is killed by Ray (`ray.kill`, which
    runs no atexit handler or destructor: the Ray actors of `runtime/ray_runtime.py`).
    `destroy_process_group` is then a no-op.

    Why: gloo's C++ teardown occasionally aborted a finished process ("terminate called without an active
    exception", SIGABRT) after every step had finished and every file was written (twice in the full test
    suite on 2 busy cores; a CI run of `test_local_two_controllers` after all its steps). The mechanism
    PyTorch's reports give (not reproduced here: 0 in 500 teardowns, BENCHMARKS.md "gloo teardown"): a
    gloo worker thread that drops the last reference to a tensor with a Python object must take the GIL;
    during interpreter finalisation CPython ends such a thread with `pthread_exit`, whose unwinding
    through a `noexcept` C++ frame calls `std::terminate` (pytorch/pytorch#65231 aborts in
    `_PyModule_ClearDict`; #179291 and #190489 on the same abort at exit). A process that leaves by
    `os._exit` runs no finalisation."""
    global _TEARDOWN
    _TEARDOWN = False


def destroy_process_group() -> None:
    """Tear the default process group down (not in a process marked by `exit_without_teardown`)."""
    if dist.is_initialized() and _TEARDOWN:
        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End a process that owns a process group, once its work is done and its result handed over:
    `flush_outputs`, then `os._exit(code)`, without the interpreter's finalisation or the group's C++
    teardown (see `exit_without_teardown`). The caller has closed its own files, loggers and workers;
    atexit handlers do not run."""
    exit_without_teardown()
    flush_outputs()
    os._exit(code)


def flush_outputs() -> None:
    """Write out what this process has printed and logged, before it ends without finalisation
    (`end_process`, or `ray.kill` of an actor)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or replaced stream must not keep the process alive
            stream.flush()


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
