"""How a controller calls the device workers of its slice, in-process or on Ray, with one API.

A `WorkerHandle` turns `handle.call("method", *args)` into a *pending* result and
`handle.stream("method", *args)` into a *stream* of results (a generator method on the worker).
`wait_any` blocks until at least one pending result or stream item is ready, `result` fetches a
pending result, `next_item` the next item of a ready stream. The in-process backend runs the call
at once (everything is ready immediately); the Ray backend submits actor tasks and streaming
generator tasks, so work on different devices runs concurrently while the controller waits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

_END = object()


class Pending(Protocol):
    """A result that may not be ready yet (`ray.ObjectRef` or `Ready`)."""


class WorkerHandle(Protocol):
    """A device worker seen from its controller."""

    def call(self, method: str, *args: Any) -> Any: ...

    def stream(self, method: str, *args: Any, backpressure: int | None = None) -> Any: ...


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

    def call(self, method: str, *args: Any) -> Ready:
        """Run the method now; `Ready` arguments are unwrapped, as Ray resolves ObjectRef arguments."""
        args = tuple(a.value if isinstance(a, Ready) else a for a in args)
        return Ready(getattr(self.worker, method)(*args))

    def stream(self, method: str, *args: Any, backpressure: int | None = None) -> LocalStream:
        return LocalStream(iter(getattr(self.worker, method)(*args)))


class RayHandle:
    """Calls a worker that is a Ray actor; results stay in the object store until fetched."""

    def __init__(self, actor: Any):
        self.actor = actor

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.actor, method).remote(*args)

    def stream(self, method: str, *args: Any, backpressure: int | None = None) -> Any:
        """`backpressure`: the generator pauses while this many yielded items are not yet taken."""
        options = {"num_returns": "streaming"}
        if backpressure is not None:
            options["_generator_backpressure_num_objects"] = backpressure
        return getattr(self.actor, method).options(**options).remote(*args)


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
