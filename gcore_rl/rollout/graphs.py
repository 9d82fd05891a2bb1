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
    """Whether an engine's replays capture CUDA graphs; the first failure turns it off for all of them, with one
    warning naming `what` (the step)."""

    def __init__(self, enabled: bool, what: str):
        self.enabled = enabled
        self.what = what

    def failed(self, error: RuntimeError) -> None:
        if self.enabled:
            warnings.warn(f"{self.what} could not be captured as a CUDA graph ({error}); it runs eagerly at static "
                          "shapes", stacklevel=3)
        self.enabled = False


class Replay:
    """`step(*inputs)` at the fixed shapes of `inputs` (static buffers, filled by the caller before each `run`),
    returning its output tensors; eager twice, then captured as a CUDA graph and replayed where `capture` is
    enabled."""

    def __init__(self, step: Callable[..., tuple[Tensor, ...]], inputs: list[Tensor], capture: GraphCapture):
        self.step, self.inputs, self.capture = step, inputs, capture
        self.outputs: tuple[Tensor, ...] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.runs = 0

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
        """Record the step with the inputs now in the buffers (it runs once more, with the same effect)."""
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            # thread_local: another thread of the process (a producer schedule's rollout beside an update, a
            # checkpoint's writer) may use CUDA while this one captures; only this thread's calls are restricted
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._eager()
        except RuntimeError as error:
            self.capture.failed(error)
            return
        self.graph = graph
