"""The engine's side of `engine.vllm.weight_sync=group`: a gloo process group between this process (rank 0) and
the vLLM server's workers, over which each update's tensors are broadcast instead of written to a file
(`vllm_ext/gcore_vllm_weights.py` is the workers' side, reached through the server's `/collective_rpc`).

Each collective runs on both sides at once: this side's part on a helper thread, while this thread sends the
RPC that makes the workers take theirs and waits for its answer (which comes once they are done). A refused RPC
(a server without the extension) raises at once; the helper's part then ends by gloo's timeout (`timeout_s`),
which is also how long a server that dies mid-broadcast can leave an update waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from gcore_rl.rollout.vllm_ext.gcore_vllm_weights import (
    CHUNK_BYTES,
    broadcast_from_engine,
    byte_sizes,
    chunk_plan,
    join_group,
    pack,
)

Post = Callable[[str, dict], dict]
"""`post(path, body) -> answer`: one HTTP call to the server."""


def update_message(tensors: Mapping[str, torch.Tensor], chunk_bytes: int) -> dict:
    """The `/collective_rpc` body that makes the workers receive `tensors` (names, dtypes, shapes, in order, packed
    into chunks of `chunk_bytes`)."""
    return {"method": "gcore_receive_weights",
            "kwargs": {"names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                       "shapes": [list(t.shape) for t in tensors.values()], "chunk_bytes": chunk_bytes}}


def _together(post: Post, body: dict, local: Callable[[], object]) -> object:
    """`local()` on a helper thread while this thread posts `body` to `/collective_rpc`; returns `local`'s result."""
    helper = ThreadPoolExecutor(1, thread_name_prefix="vllm-weights")
    try:
        mine = helper.submit(local)
        post("/collective_rpc", body)
        return mine.result()
    finally:
        helper.shutdown(wait=False)


class WeightGroup:
    """A gloo group of this process and a server's `workers` workers (`post` reaches the server)."""

    def __init__(self, post: Post, port: int, workers: int = 1, timeout_s: float = 120.0,
                 chunk_bytes: int = CHUNK_BYTES):
        self._post = post
        self.chunk_bytes = chunk_bytes
        body = {"method": "gcore_join_weight_group",
                "kwargs": {"host": "127.0.0.1", "port": port, "world_size": 1 + workers, "timeout_s": timeout_s}}
        self.group = _together(post, body, lambda: join_group("127.0.0.1", port, 0, 1 + workers, timeout_s))

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Broadcast one update (host tensors) to the workers, which reload them in place."""
        message = update_message(tensors, self.chunk_bytes)
        values = list(tensors.values())

        def broadcast_all() -> None:
            for chunk in chunk_plan(byte_sizes(message["kwargs"]["dtypes"], message["kwargs"]["shapes"]), self.chunk_bytes):
                broadcast_from_engine(self.group, pack([values[i] for i in chunk]))

        _together(self._post, message, broadcast_all)
