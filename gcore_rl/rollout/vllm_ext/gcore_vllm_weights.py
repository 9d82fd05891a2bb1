"""Loaded into vLLM's worker processes (`--worker-extension-cls gcore_vllm_weights.WeightGroupExtension`), from the
vLLM environment: imports nothing of gcore-rl, only torch, which both environments pin to the same version.

`engine.vllm.weight_sync=group`: instead of a safetensors file that the server reloads, the engine's process and
the server's workers form a gloo process group of their own (the engine rank 0, worker `r` rank 1 + r; a TCPStore
the engine hosts), and each update's tensors are broadcast from the engine to every worker, which reloads them
in place (vLLM's `reload_weights`, the layer-wise reload that also serves a CPU server's repacked weights). The
methods are called through the server's `/collective_rpc`, on every worker at once, while the engine's process
takes part in the same collectives from its side (`gcore_rl.rollout.vllm_weight_group`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

STORE_PREFIX = "gcore-weights"


def broadcast_from_engine(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 (the engine) to the group, in place on the receivers."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


def join_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of `world_size` ranks met at the TCPStore `host:port` (hosted by rank 0)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, timeout)


class WeightGroupExtension:
    """Methods mixed into vLLM's worker class (`self` is the worker: `rank`, `reload_weights`)."""

    def gcore_join_weight_group(self, host: str, port: int, world_size: int, timeout_s: float) -> int:
        """Join the engine's group as rank 1 + this worker's rank; returns that rank."""
        rank = 1 + int(getattr(self, "rank", 0))
        self._gcore_weight_group = join_group(host, port, rank, world_size, timeout_s)
        return rank

    def gcore_receive_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        """Receive one update's tensors (in the order named) and reload them in place; returns how many."""
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            broadcast_from_engine(self._gcore_weight_group, tensor)
            received.append((name, tensor))
        self.reload_weights(weights_iterator=iter(received))
        return len(received)
