"""A step at static shapes, replayed as a CUDA graph on a GPU: the capture both engines share (issue 49).

A CUDA graph records the kernels one call launched and replays them with one launch, which is what a
small model's step needs on a GPU, where launching its hundreds of kernels one by one costs more than
running them. A replay reads its inputs from, and writes its outputs to, the addresses it recorded, so
a `Replay` owns static input buffers (the caller fills them before each `run`) and keeps the outputs of
its first run as its output buffers. Its first two runs are eager (a warm-up, which also allocates what
the step creates lazily); after the second, the step is recorded (a capture launches nothing) and every
later run replays it. Whatever a step reads
that is not an input (weights, a KV pool) must keep its storage: an engine drops its replays when its
weights move (sleep) or its pool is reallocated. A capture that fails (a step that reads a value back to
the host, which a graph cannot record) leaves the engine eager, with one warning.

On a CPU the same `Replay` runs the step eagerly every time: the static-shape path is tested there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor


class GraphCapture:
    """Whether an engine's replays capture CUDA graphs, and the memory pool their captures share (one per engine:
    the replays never run at once, and none of them leaves an output in the pool: each copies its outputs into
    buffers of its own). The first failed capture turns capturing off for the engine, with one warning naming
    `what` (the step)."""

    def __init__(self, enabled: bool, what: str):
        self.enabled = enabled
        self.what = what
        self.pool = None  # graph_pool_handle(), made at the first capture

    def failed(self, error: Exception) -> None:
        if self.enabled:
            warnings.warn(f"{self.what} could not be captured as a CUDA graph ({error}); it runs eagerly at static "
                          "shapes", stacklevel=3)
        self.enabled = False


class Replay:
    """`step(*inputs)` at the fixed shapes of `inputs` (static buffers, filled through `load` or by the caller before
    each `run`), returning its output tensors; eager twice, then captured as a CUDA graph and replayed where
    `capture` is enabled."""

    def __init__(self, step: Callable[..., tuple[Tensor, ...]], inputs: list[Tensor], capture: GraphCapture):
        self.step, self.inputs, self.capture = step, inputs, capture
        self.outputs: tuple[Tensor, ...] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.runs = 0
        self._loaded: list[Tensor | None] = [None] * len(inputs)

    def load(self, values: list[Tensor]) -> None:
        """Copy `values` into the input buffers, skipping a value that is the very tensor loaded last time (a batch's
        text conditioning, the same from step to step): a tensor passed again must not have changed in place."""
        for i, (buffer, value) in enumerate(zip(self.inputs, values, strict=True)):
            if value is not self._loaded[i]:
                buffer.copy_(value)
                self._loaded[i] = value

    def run(self) -> tuple[Tensor, ...]:
        """The step's outputs for the inputs now in the buffers (the output buffers: overwritten by the next run)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._eager()
            self.runs += 1
            if self.runs == 2 and self.capture.enabled:
                self._capture()
        return self.outputs

    def _eager(self) -> None:
        results = self.step(*self.inputs)
        if self.outputs is None:
            self.outputs = tuple(r.clone() for r in results)
        else:
            for buffer, result in zip(self.outputs, results, strict=True):
                buffer.copy_(result)

    def _capture(self) -> None:
        """Record the step with the inputs now in the buffers (a capture launches nothing: the outputs stay the
        second eager run's). On the inputs' device, which need not be the calling thread's current one (a
        producer schedule generates from a thread of its own); a failure, or a capture that recorded nothing,
        leaves this replay and the engine's others eager."""
        device = self.inputs[0].device
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            try:
                torch.cuda.synchronize(device)
                if self.capture.pool is None:
                    self.capture.pool = torch.cuda.graph_pool_handle()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    # thread_local: another thread of the process (a producer schedule's rollout beside an
                    # update, a checkpoint's writer) may use CUDA while this one captures
                    with torch.cuda.graph(graph, pool=self.capture.pool, capture_error_mode="thread_local"):
                        self._eager()
                empty = [w for w in caught if "graph is empty" in str(w.message).lower()]
                for w in caught:  # the others are the caller's to see
                    if w not in empty:
                        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
                if empty:
                    raise RuntimeError(str(empty[0].message))
            except RuntimeError as error:
                torch.cuda.set_stream(stream)  # a capture that failed inside may leave its side stream current
                self.capture.failed(error)
                return
        self.graph = graph
