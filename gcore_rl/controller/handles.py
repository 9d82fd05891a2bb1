"""How a controller calls the device workers of its slice, in-process or on Ray, with one API.

A `WorkerHandle` turns `handle.call(WorkerAPI.method, *args)` into a *pending* result and
`handle.stream(WorkerAPI.method, *args)` into a *stream* of results (a generator method on the
worker). Methods are named by reference to the `WorkerAPI` protocol (controller/worker_api.py), not
by string, so the call is checked against the worker's typed signature.
`wait_any` blocks until at least one pending result or stream item is ready, `result` fetches a
pending result, `next_item` the next item of a ready stream. The in-process backend runs the call
at once (everything is ready immediately); the Ray backend submits actor tasks and streaming
generator tasks, so work on different devices runs concurrently while the controller waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

_END = object()
P = ParamSpec("P")
R = TypeVar("R")
Method = Callable[Concatenate[Any, P], R]
"""A worker method by reference (`WorkerAPI.train`): its first parameter is the worker itself."""


def method_name(method: Callable[..., Any]) -> str:
    """The name a method reference dispatches to (TypeError for a string: name methods by reference)."""
    if isinstance(method, str):
        raise TypeError(f"name the worker method by reference (WorkerAPI.{method}), not by the string {method!r}")
    return method.__name__


class Pending(Protocol):
    """A result that may not be ready yet (`ray.ObjectRef` or `Ready`)."""


class WorkerHandle(Protocol):
    """A device worker seen from its controller."""

    def call(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def stream(self, method: Method[P, Iterator[R]], *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def bounded_stream(self, in_flight: int, method: Method[P, Iterator[R]], *args: P.args, **kwargs: P.kwargs) -> Any: ...


class Ready:
    """A pending result that is already there (in-process calls)."""

    def __init__(self, value: Any):
        self.value = value


class LocalStream:
    """A generator method of an in-process worker; always ready, `next_item` advances it."""

    def __init__(self, iterator: Iterator[Any]):
        self._iterator = iterator


class LocalHandle:
    """Calls a worker object living in this process."""

    def __init__(self, worker: Any):
        self.worker = worker

    def call(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> Ready:
        """Run the method now; `Ready` arguments are unwrapped, as Ray resolves ObjectRef arguments."""
        args = tuple(a.value if isinstance(a, Ready) else a for a in args)
        return Ready(getattr(self.worker, method_name(method))(*args, **kwargs))

    def stream(self, method: Method[P, Iterator[R]], *args: P.args, **kwargs: P.kwargs) -> LocalStream:
        return LocalStream(iter(getattr(self.worker, method_name(method))(*args, **kwargs)))

    def bounded_stream(self, in_flight: int, method: Method[P, Iterator[R]], *args: P.args,
                       **kwargs: P.kwargs) -> LocalStream:
        """In-process the consumer pulls each item, so nothing is ever ahead of it."""
        return self.stream(method, *args, **kwargs)


class RayHandle:
    """Calls a worker that is a Ray actor; results stay in the object store until fetched."""

    def __init__(self, actor: Any):
        self.actor = actor

    def call(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> Any:
        return getattr(self.actor, method_name(method)).remote(*args, **kwargs)

    def stream(self, method: Method[P, Iterator[R]], *args: P.args, **kwargs: P.kwargs) -> Any:
        return getattr(self.actor, method_name(method)).options(num_returns="streaming").remote(*args, **kwargs)

    def bounded_stream(self, in_flight: int, method: Method[P, Iterator[R]], *args: P.args, **kwargs: P.kwargs) -> Any:
        """A stream whose generator pauses while `in_flight` yielded items are not yet taken."""
        options = {"num_returns": "streaming", "_generator_backpressure_num_objects": in_flight}
        return getattr(self.actor, method_name(method)).options(**options).remote(*args, **kwargs)


def _is_local(item: Any) -> bool:
    return isinstance(item, (Ready, LocalStream))


def wait_any(items: Sequence[Any]) -> list[Any]:
    """The items (pending results or streams) that are ready now, waiting for at least one."""
    local = [item for item in items if _is_local(item)]
    if local:
        return local
    import ray

    ready, _ = ray.wait(list(items), num_returns=1)
    return ready


def result(pending: Any) -> Any:
    """The value of a pending result (blocks until it is there)."""
    if isinstance(pending, Ready):
        return pending.value
    import ray

    return ray.get(pending)


def results(pendings: Sequence[Any]) -> list[Any]:
    """Values of several pending results, in order (fetched together on Ray)."""
    if all(isinstance(p, Ready) for p in pendings):
        return [p.value for p in pendings]
    import ray

    return ray.get(list(pendings))


def next_item(stream: Any) -> Any:
    """The next item of a ready stream, or `END` when the stream is exhausted."""
    if isinstance(stream, LocalStream):
        return next(stream._iterator, _END)
    import ray

    try:
        ref = next(stream)
    except StopIteration:
        return _END
    return ray.get(ref)


def next_ref(stream: Any) -> Any:
    """The next item of a stream as something to pass on to another worker's call without fetching
    it here (an object reference on Ray, the value in-process), or `END`; blocks until it is there."""
    if isinstance(stream, LocalStream):
        return next(stream._iterator, _END)
    try:
        return next(stream)
    except StopIteration:
        return _END


END = _END
"""Returned by `next_item` when a stream has no more items."""
