"""Loaded into vLLM's worker processes with the other worker methods (`gcore_vllm_worker.WorkerExtension`), from the
vLLM environment: imports nothing of gcore-rl, only torch, which both environments pin to the same version.

`engine.vllm.weight_sync=group`: instead of a safetensors file that the server reloads, the engine's process and
the server's workers form a gloo process group of their own (the engine rank 0, worker `r` rank 1 + r; a TCPStore
the engine hosts), and each update's tensors are broadcast from the engine to every worker (packed into byte
buffers of about `CHUNK_BYTES`), which reloads them
in place (vLLM's `reload_weights`, the layer-wise reload that also serves a CPU server's repacked weights). The
methods are called through the server's `/collective_rpc`, on every worker at once, while the engine's process
takes part in the same collectives from its side (`gcore_rl.rollout.vllm_weight_group`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

STORE_PREFIX = "gcore-weights"
CHUNK_BYTES = 64 * 2**20
"""Tensors travel packed into byte buffers of about this size (a larger tensor alone): one broadcast per buffer,
not per tensor (each broadcast is a round trip)."""


def chunk_plan(sizes: list[int], limit: int = CHUNK_BYTES) -> list[list[int]]:
    """Consecutive indices of tensors of `sizes` bytes grouped into chunks of at most `limit` bytes (a tensor
    larger than `limit` is a chunk of its own); both sides compute it from the update's names, dtypes, shapes."""
    chunks: list[list[int]] = []
    used = limit
    for index, size in enumerate(sizes):
        if used + size > limit:
            chunks.append([])
            used = 0
        chunks[-1].append(index)
        used += size
    return chunks


def byte_sizes(dtypes: list[str], shapes: list[list[int]]) -> list[int]:
    """Bytes of each tensor of an update."""
    out = []
    for dtype, shape in zip(dtypes, shapes, strict=True):
        numel = 1
        for dim in shape:
            numel *= dim
        out.append(numel * torch.empty((), dtype=getattr(torch, dtype)).element_size())
    return out


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, concatenated into one uint8 buffer."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def unpack(buffer: torch.Tensor, dtypes: list[str], shapes: list[list[int]]) -> list[torch.Tensor]:
    """The tensors `pack` put into `buffer` (views of it)."""
    out, offset = [], 0
    for dtype, shape, size in zip(dtypes, shapes, byte_sizes(dtypes, shapes), strict=True):
        out.append(buffer[offset:offset + size].view(getattr(torch, dtype)).view(shape))
        offset += size
    return out


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

    def gcore_receive_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                              chunk_bytes: int = CHUNK_BYTES) -> int:
        """Receive one update's tensors (in the order named, packed into chunks of `chunk_bytes`) and reload them in
        place; returns how many."""
        received = []
        for chunk in chunk_plan(byte_sizes(dtypes, shapes), chunk_bytes):
            kinds, dims = [dtypes[i] for i in chunk], [shapes[i] for i in chunk]
            buffer = torch.empty(sum(byte_sizes(kinds, dims)), dtype=torch.uint8)
            broadcast_from_engine(self._gcore_weight_group, buffer)
            received += zip([names[i] for i in chunk], unpack(buffer, kinds, dims), strict=True)
        self.reload_weights(weights_iterator=iter(received))
        return len(received)
