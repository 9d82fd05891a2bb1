"""How a controller calls the device workers of its slice, in-process or on Ray, with one API.

A `WorkerHandle` turns `handle.call(WorkerAPI.method, *args)` into a *pending* result and
`handle.stream(WorkerAPI.method, *args)` into a *stream* of results (a generator method on the
worker). Methods are named by reference to the `WorkerAPI` protocol (controller/worker_api.py), not
by string, so the call is checked against the worker's typed signature.
`wait_any` blocks until at least one pending result or stream item is ready, `result` fetches a
pending result, `next_item` the next item of a ready stream. The in-process backend runs the call
at once (everything is ready immediately); the Ray backend submits actor tasks and streaming
generator tasks, so work on different devices runs concurrently while the controller waits.

When a worker's process dies while a call or stream of it is pending, `result` and `next_item`
raise `WorkerLost`. A handle that is `restartable` (a Ray actor that Ray restarts, and that its
runtime knows how to set up again) can then be brought back with `revive`; its `incarnation`
counts the revivals, so a caller holding several broken calls of one worker revives it once.
"""

from __future__ import annotations

import contextlib
import time
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


class WorkerLost(RuntimeError):
    """The process of a worker died while a call or stream of it was pending (Ray: `RayActorError`)."""


class Pending(Protocol):
    """A result that may not be ready yet (`ray.ObjectRef` or `Ready`)."""


class WorkerHandle(Protocol):
    """A device worker seen from its controller."""

    restartable: bool
    incarnation: int

    def revive(self) -> None: ...

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
    """Calls a worker object living in this process (which dies with it: never restartable)."""

    restartable = False
    incarnation = 0

    def __init__(self, worker: Any):
        self.worker = worker

    def revive(self) -> None:
        raise RuntimeError("an in-process worker cannot be restarted")

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
    """Calls a worker that is a Ray actor; results stay in the object store until fetched.

    `setup(actor)`, when given, sets up a fresh process of the actor (one Ray restarted after its
    process died) as the first one was; the handle is then `restartable`.
    """

    def __init__(self, actor: Any, setup: Callable[[Any], None] | None = None):
        self.actor = actor
        self._setup = setup
        self.restartable = setup is not None
        self.incarnation = 0

    def revive(self, timeout_s: float = 300.0) -> None:
        """Set up the actor's restarted process, once Ray has restarted it (`WorkerLost` when Ray gives
        up on it: no restarts left, or not back within `timeout_s`)."""
        import ray

        if self._setup is None:
            raise RuntimeError("this worker's runtime does not restart it")
        deadline = time.monotonic() + timeout_s
        with _lost_as_worker_lost():
            while True:
                try:
                    self._setup(self.actor)
                    break
                except ray.exceptions.ActorUnavailableError:  # still restarting: a call now is refused, not queued
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        self.incarnation += 1

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


@contextlib.contextmanager
def _lost_as_worker_lost() -> Iterator[None]:
    """Turn the death of a Ray actor into `WorkerLost` (the Ray exception is kept as its cause)."""
    import ray

    try:
        yield
    except ray.exceptions.RayActorError as exc:
        raise WorkerLost(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, WorkerLost):  # a restarted worker that was not set up again
            raise WorkerLost(str(exc.cause)) from exc
        raise


def result(pending: Any) -> Any:
    """The value of a pending result (blocks until it is there; `WorkerLost` when its worker died)."""
    if isinstance(pending, Ready):
        return pending.value
    import ray

    with _lost_as_worker_lost():
        return ray.get(pending)


def results(pendings: Sequence[Any]) -> list[Any]:
    """Values of several pending results, in order (fetched together on Ray; `WorkerLost` when a worker died)."""
    if all(isinstance(p, Ready) for p in pendings):
        return [p.value for p in pendings]
    import ray

    with _lost_as_worker_lost():
        return ray.get(list(pendings))


def next_item(stream: Any) -> Any:
    """The next item of a ready stream, or `END` when the stream is exhausted (`WorkerLost` when its worker died)."""
    if isinstance(stream, LocalStream):
        return next(stream._iterator, _END)
    import ray

    with _lost_as_worker_lost():
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
