"""`Replay`'s capture logic (gcore_rl/rollout/graphs.py) on a CPU, with `torch.cuda`'s graph calls faked: when it
captures, what it replays, the one memory pool an engine's captures share, and the fallbacks that only a GPU
would otherwise reach (a capture that fails inside, one that records nothing)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from gcore_rl.rollout.graphs import GraphCapture, Replay


class FakeCuda:
    """Stands in for the `torch.cuda` calls a capture makes; `fail` / `empty` make the next captures fail inside
    (as `capture_end` does after a host read) or record nothing (PyTorch then only warns)."""

    def __init__(self, monkeypatch, fail: bool = False, empty: bool = False):
        self.fail, self.empty = fail, empty
        self.graphs: list[FakeGraph] = []
        self.pools: list[object] = []  # the pool each capture was given
        self.handles = 0
        self.streams_set: list[object] = []
        self.current = "default stream"
        for name, value in (("CUDAGraph", self._graph), ("graph", self._capture), ("device", self._device),
                            ("current_stream", lambda device=None: self.current), ("synchronize", lambda device=None: None),
                            ("graph_pool_handle", self._handle), ("set_stream", self._set_stream)):
            monkeypatch.setattr(torch.cuda, name, value)

    def _graph(self):
        self.graphs.append(FakeGraph())
        return self.graphs[-1]

    def _handle(self):
        self.handles += 1
        return f"pool {self.handles}"

    def _set_stream(self, stream):
        self.streams_set.append(stream)
        self.current = stream

    @contextlib.contextmanager
    def _device(self, device):
        yield

    @contextlib.contextmanager
    def _capture(self, graph, pool=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"
        self.pools.append(pool)
        self.current = "capture stream"  # as torch.cuda.graph's stream context does
        yield
        if self.fail:  # capture_end raises and the stream context is never left
            raise RuntimeError("operation not permitted when stream is capturing")
        if self.empty:
            warnings.warn("The CUDA Graph is empty. This usually means that the graph was attempted to be captured "
                          "on wrong device or stream.", stacklevel=2)
        self.current = "default stream"


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def _replay(capture: GraphCapture, calls: list[int]) -> Replay:
    def step(x: torch.Tensor) -> tuple[torch.Tensor]:
        calls.append(1)
        return (x * 2,)

    return Replay(step, [torch.zeros(3)], capture)


def test_a_replay_runs_eagerly_twice_then_captures_and_replays_in_the_engines_one_pool(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    capture, calls = GraphCapture(True, "the step"), []
    first, second = _replay(capture, calls), _replay(capture, calls)
    for value in (1.0, 2.0, 3.0, 4.0):
        first.load([torch.full((3,), value)])
        out = first.run()
    assert len(calls) == 3  # two eager runs, then the step once more inside the capture
    assert first.graph is cuda.graphs[0] and cuda.graphs[0].replays == 2
    assert torch.equal(out[0], torch.full((3,), 4.0))  # the second eager run's output (the fake replay computes nothing)
    for _ in range(3):
        second.run()
    assert cuda.handles == 1 and cuda.pools == ["pool 1", "pool 1"]  # one pool for the engine's captures


def test_the_same_tensor_loaded_again_is_not_copied_again():
    replay = _replay(GraphCapture(False, "the step"), [])
    text = torch.ones(3)
    replay.load([text])
    text.fill_(5.0)  # a change made in place is not seen: the caller promises none
    replay.load([text])
    assert torch.equal(replay.inputs[0], torch.ones(3))
    replay.load([text.clone()])
    assert torch.equal(replay.inputs[0], torch.full((3,), 5.0))


@pytest.mark.parametrize("fail,empty", [(True, False), (False, True)])
def test_a_capture_that_fails_or_records_nothing_leaves_the_engine_eager_with_one_warning(monkeypatch, fail, empty):
    cuda = FakeCuda(monkeypatch, fail=fail, empty=empty)
    capture, calls = GraphCapture(True, "the step"), []
    first, second = _replay(capture, calls), _replay(capture, calls)
    with pytest.warns(UserWarning, match="the step could not be captured as a CUDA graph") as caught:
        for value in (1.0, 2.0, 3.0):
            first.load([torch.full((3,), value)])
            out = first.run()
    assert len(caught) == 1 and not capture.enabled and first.graph is None
    assert torch.equal(out[0], torch.full((3,), 6.0))  # eager, with the new input
    assert cuda.current == "default stream"  # the failed capture's side stream is no longer current
    if fail:
        assert cuda.streams_set == ["default stream"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the engine's other replays stay eager, without a second warning
        for _ in range(3):
            second.run()
    assert second.graph is None and len(cuda.graphs) == 1
