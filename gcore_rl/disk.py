"""A write that fails because of the disk, said in one paragraph: which file, how much room there is, what to do.

A full disk does not always say so. Python's own writes raise `OSError` with `errno.ENOSPC`, but
`torch.save` (which DCP writes every checkpoint shard with) reports a short write as
``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598``, wrapped by DCP
in a `CheckpointException`. So a failed write is blamed on the disk when its error carries a no-space
errno anywhere in its chain, or when the filesystem it wrote to has less room left than the write
needed (at least `LOW_BYTES`). `writing(path, what, needed)` turns either into a `DiskError` naming the
path, the bytes free and the bytes needed; a folder that refuses writes (`EACCES`, `EROFS`) gets one too.
Every other failure passes through unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from gcore_rl.errors import DiskError

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
UNWRITABLE = frozenset({errno.EACCES, errno.EROFS, errno.EPERM})
LOW_BYTES = 1 << 20
"""Free bytes below which a write that failed for a reason it did not name is taken for a full disk."""

ADVICE = ("Every checkpoint and output written before it is intact (`run.resume=auto` takes the newest complete "
          "checkpoint, never an unfinished one); make room, or point run.output_dir / run.checkpoint_dir at another "
          "disk, then continue with run.resume=auto.")


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the filesystem that holds `path` (or its nearest existing parent); None
    when none can be read."""
    for folder in (Path(path), *Path(path).parents):
        with contextlib.suppress(OSError):
            if folder.exists():
                return shutil.disk_usage(folder).free
    return None


def _errnos(exc: BaseException) -> set[int]:
    """The errnos of `exc` and of the exceptions it was raised from or during (DCP keeps its ranks' failures
    in `failures`)."""
    seen, out, todo = set(), set(), [exc]
    while todo:
        err = todo.pop()
        if isinstance(err, tuple):  # DCP's (exception, traceback) per failed rank
            todo += [part for part in err if isinstance(part, BaseException)]
            continue
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            out.add(err.errno)
        todo += [err.__cause__, err.__context__, *getattr(err, "failures", {}).values()]
    return out


def disk_error(path: str | Path, what: str, exc: BaseException, needed: int | None = None) -> DiskError | None:
    """The `DiskError` for a write of `what` to `path` that failed with `exc`, when the disk is its cause;
    None otherwise. `needed`: the bytes the write needed, when known."""
    codes = _errnos(exc)
    free = free_bytes(path)
    need = f"; it needed about {needed:,} bytes" if needed else ""
    if codes & UNWRITABLE and not codes & NO_SPACE:
        return DiskError(f"could not write {what} '{path}': the folder is not writable ({_reason(exc, codes)}). "
                         + ADVICE)
    if codes & NO_SPACE or (free is not None and free < max(needed or 0, LOW_BYTES)):
        room = f"{free:,} bytes are free there" if free is not None else "the free space could not be read"
        return DiskError(f"could not write {what} '{path}': the disk is full ({room}{need}). " + ADVICE)
    return None


def _reason(exc: BaseException, codes: set[int]) -> str:
    code = next(iter(sorted(codes & UNWRITABLE)))
    return f"{errno.errorcode.get(code, code)}: {' '.join(str(exc).split())[:200]}"


@contextlib.contextmanager
def writing(path: str | Path, what: str, needed: int | None = None) -> Iterator[None]:
    """Raise a `DiskError` instead of the failure of the writes in the block when the disk caused it (see
    the module docstring); any other failure, and a `DiskError` already raised, pass through."""
    try:
        yield
    except (DiskError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException; only the disk's failures are replaced
        error = disk_error(path, what, exc, needed)
        if error is None:
            raise
        raise error from None
