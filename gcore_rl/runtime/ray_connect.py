"""Joining a running Ray cluster (`runtime.ray_address`): token authentication, and fast, plain failures.

Ray 2.60 clusters started with `ray start` use token authentication whenever a token exists on the
head node (`~/.ray/auth_token`, which `ray start` finds and which any local `ray.init()` creates),
and a driver sends its token only when `RAY_AUTH_MODE=token` is set in its environment. `ray.init`
sets that mode itself for `address="auto"` but not for an explicit `host:port`, so a job that names
its cluster would retry for 20 s ("Authentication token is missing or incorrect") and die with a
traceback. `connect` therefore:

1. turns token mode on when `RAY_AUTH_MODE` is unset and a token is found (`RAY_AUTH_TOKEN`,
   `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token`); a cluster without authentication ignores it;
2. resolves `auto` (the cluster `ray start` last started on this machine, or `RAY_ADDRESS`);
3. opens a TCP connection to the cluster's GCS port, bounded by `REACH_TIMEOUT_S`, and asks the GCS
   for its cluster id once, so that an unreachable address or a refused token is reported at once;
4. and only then calls `ray.init`.

Every failure is a `GcoreError` whose message is one paragraph saying what to do.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

from gcore_rl.errors import GcoreError

#: Seconds to wait for a TCP connection to the cluster's GCS port before calling it unreachable.
REACH_TIMEOUT_S = 10.0
AUTH_MODE_ENV = "RAY_AUTH_MODE"

_START_HINT = ("start one on the head node with `ray start --head --port=6379 --resources='{\"device\": 4}'` "
               "(docs/ray.md), give its `host:port` as runtime.ray_address, or leave "
               "runtime.ray_address empty to let the job start a Ray instance of its own")


def connect(address: str, **init_kwargs) -> None:
    """`ray.init(address)` for a running cluster, with token authentication handled (see the module docstring)."""
    import ray

    enable_token_auth_if_token_found()
    gcs = resolve_address(address)
    check_reachable(gcs, address)
    check_token_accepted(gcs)
    try:
        ray.init(address=gcs, **init_kwargs)
    except ConnectionError as exc:
        raise GcoreError(f"could not join the Ray cluster at {gcs} (runtime.ray_address={address}): "
                         f"{_first_line(exc)}; check that it is running with `ray status --address={gcs}`, "
                         f"or {_START_HINT}") from None


def enable_token_auth_if_token_found() -> bool:
    """Set `RAY_AUTH_MODE=token` for this process (and the processes it starts) when it is unset and a token exists.

    Returns whether token mode is on afterwards. A Ray without token authentication leaves it off.
    """
    if os.environ.get(AUTH_MODE_ENV) is not None:
        return os.environ[AUTH_MODE_ENV].lower() == "token"
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray before token authentication
        return False
    # also refreshes Ray's cached config, which `import ray` has already read
    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def resolve_address(address: str) -> str:
    """`host:port` of the cluster's GCS; `auto` is resolved as `ray.init` resolves it."""
    from ray._private import services

    try:
        gcs = services.canonicalize_bootstrap_address(address)
    except ConnectionError:
        raise GcoreError(f"runtime.ray_address={address} found no running Ray cluster on this machine "
                         f"(`auto` means the one `ray start` last started here, or $RAY_ADDRESS): {_START_HINT}"
                         ) from None
    except ValueError as exc:
        raise GcoreError(f"runtime.ray_address={address} is not a Ray address ({exc}); give `host:port` of the "
                         f"head node (the `--port` of `ray start --head`, 6379 by default) or `auto`") from None
    if gcs is None:  # "local"
        raise GcoreError(f"runtime.ray_address={address} does not name a cluster; to let the job start its own "
                         f"Ray instance leave runtime.ray_address empty")
    return gcs


def check_reachable(gcs: str, address: str, timeout: float = REACH_TIMEOUT_S) -> None:
    """Raise a `GcoreError` unless something accepts TCP connections at `gcs` within `timeout` seconds."""
    host, _, port = gcs.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return
    except (OSError, ValueError) as exc:
        reason = f"no answer within {timeout:.0f} s" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
    given = "" if gcs == address else f" (runtime.ray_address={address})"
    raise GcoreError(f"no Ray cluster answers at {gcs}{given}: {reason}. Check the host and the port (the "
                     f"`--port` of `ray start --head`, 6379 by default) and that the head node is running "
                     f"(`ray status --address={gcs}` there), or {_START_HINT}") from None


def check_token_accepted(gcs: str) -> None:
    """Ask the GCS at `gcs` for its cluster id once; a refused or missing token becomes a `GcoreError` at once.

    Without this, `ray.init` retries a refused token for 20 s and raises a bare `ConnectionError`.
    Any other failure is left to `ray.init` to report.
    """
    try:
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:  # a Ray without token authentication
        return
    try:
        with _quiet_stderr():  # Ray's C++ client logs each refused call before raising
            GcsClient(address=gcs)
    except AuthenticationError:
        mode = os.environ.get(AUTH_MODE_ENV)
        if mode is not None and mode.lower() != "token":
            why = (f"this job's environment sets {AUTH_MODE_ENV}={mode}, so it sends no token; unset it (a token "
                   f"is then used when one is found) or set {AUTH_MODE_ENV}=token")
        elif _token_source() is None:
            why = ("this job found no token; copy the head node's token (`ray get-auth-token` there prints it, "
                   "it is stored in ~/.ray/auth_token) to ~/.ray/auth_token here, or point RAY_AUTH_TOKEN_PATH at "
                   "a file holding it, or set RAY_AUTH_TOKEN")
        else:
            why = (f"the token this job sent ({_token_source()}) is not the cluster's; use the head node's token "
                   f"(`ray get-auth-token` there prints it) in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
                   f"RAY_AUTH_TOKEN, or restart the cluster with `ray start` as the user whose token you have")
        raise GcoreError(f"the Ray cluster at {gcs} uses token authentication and refused this job: {why}. "
                         f"(A cluster started with {AUTH_MODE_ENV}=disabled needs no token.)") from None
    except Exception:  # noqa: BLE001 - not an authentication failure; `ray.init` reports it with its own retries
        return


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 (C++ logging included) to /dev/null for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _token_source() -> str | None:
    """Where Ray would read this process's token from, or None when there is none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"RAY_AUTH_TOKEN_PATH={path}" if os.path.isfile(path) else None
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return default if os.path.isfile(default) else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
