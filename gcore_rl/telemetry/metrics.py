"""Step metrics as JSON lines (``metrics.jsonl``) and wall-clock timing of training phases."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

METRICS_FILENAME = "metrics.jsonl"
_RESERVED = ("step", "time")

__all__ = ["METRICS_FILENAME", "MetricsWriter", "PhaseTimer", "read_metrics"]


def _resolve(path: str | Path) -> Path:
    """A directory (existing, or a path without a suffix) means ``<dir>/metrics.jsonl``."""
    p = Path(path)
    if p.is_dir() or (not p.exists() and p.suffix == ""):
        return p / METRICS_FILENAME
    return p


def _json_value(key: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    try:
        number = float(value)  # floats, numpy scalars, 0-d tensors
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from None
    return number if math.isfinite(number) else None


class MetricsWriter:
    """Appends one JSON object per step: ``{"step": 3, "time": 1712345678.9, "loss": 0.41, ...}``.

    `path` is the metrics file, or a run directory in which ``metrics.jsonl`` is used (the
    directory is created). NaN and infinite values are written as ``null`` so every line is
    strict JSON. Each line is flushed as soon as it is written.
    """

    def __init__(self, path: str | Path):
        self.path = _resolve(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float | int]) -> None:
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            if key in _RESERVED:
                raise ValueError(f"metric name {key!r} is reserved for the record itself")
            record[key] = _json_value(key, value)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file (or of ``<dir>/metrics.jsonl``), in order.

    A truncated last line (a run killed mid-write) is skipped; a bad line elsewhere raises
    ValueError naming its line number.
    """
    p = _resolve(path)
    lines = p.read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{p}:{number}: not a JSON line ({exc})") from None
    return records


class PhaseTimer:
    """Accumulates wall-clock seconds per named phase.

    ``with timer.phase("generate"): ...`` adds the block's duration to "generate"; phases may be
    nested, and then each one counts its own full duration. `timings()` reports the totals since
    the last `reset()`. An optional `on_span(name, start, end)` sees every finished block
    (`clock` seconds, by default `time.perf_counter`'s), e.g. to write timeline events.
    """

    def __init__(self, on_span: Callable[[str, float, float], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._seconds: dict[str, float] = {}
        self._on_span = on_span
        self._clock = clock

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            end = self._clock()
            self._seconds[name] = self._seconds.get(name, 0.0) + (end - start)
            if self._on_span is not None:
                self._on_span(name, start, end)

    def timings(self, prefix: str = "time/") -> dict[str, float]:
        return {f"{prefix}{name}": seconds for name, seconds in self._seconds.items()}

    def reset(self) -> None:
        self._seconds.clear()


_peak_before_resets_mib = 0.0
"""The process's high-water mark as it was before the last `reset_peak_rss`."""


def peak_rss_mib() -> float:
    """This process's own peak resident memory in MiB over its whole life: `VmHWM` of /proc/self/status (and
    what it was before any `reset_peak_rss`).

    Not `getrusage(RUSAGE_SELF).ru_maxrss`: on Linux that carries the peak of the process that forked
    this one over fork and exec, so a controller spawned by a large driver would report the driver's
    peak. Falls back to `ru_maxrss` where /proc is absent (not Linux).
    """
    return max(high_water_mib(), _peak_before_resets_mib)


def high_water_mib() -> float:
    """`VmHWM` in MiB: the peak since the process began or since the last `reset_peak_rss`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Reset this process's `VmHWM` to its current resident set (Linux's /proc/self/clear_refs, value 5),
    keeping the peak so far for `peak_rss_mib`; False where that is not possible (not Linux, or not allowed)."""
    global _peak_before_resets_mib
    _peak_before_resets_mib = peak_rss_mib()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PhasePeaks:
    """The peak memory of a process in each of its phases: resident memory, and on a CUDA device the bytes the
    caching allocator handed out.

    `close(phase)`, called as a phase ends, takes the high-water mark since the last close as that phase's
    peak and resets it, so each phase's peak is its own (and what the process held as it began). Where the
    mark cannot be reset (`reset_peak_rss`), every phase reports the process's peak so far. `take` returns
    ``memory/rss_peak_mib/<phase>_max`` (the phase's name with '/' as '_') for the phases since the last take,
    and with a CUDA `device` also ``memory/cuda_peak_mib/<phase>_max`` (`torch.cuda.max_memory_allocated`,
    reset at each close) and ``memory/cuda_peak_allocated_mib_max``, the device's peak over the process's
    life (which the resets would otherwise hide).
    """

    def __init__(self, device: Any = None) -> None:
        self._peaks: dict[str, float] = {}
        self._cuda_peaks: dict[str, float] = {}
        self._cuda = device if device is not None and getattr(device, "type", None) == "cuda" else None
        self._cuda_lifetime_mib = 0.0
        reset_peak_rss()

    def close(self, phase: str) -> None:
        self._peaks[phase] = max(self._peaks.get(phase, 0.0), high_water_mib())
        reset_peak_rss()
        if self._cuda is not None:
            import torch

            peak = torch.cuda.max_memory_allocated(self._cuda) / 2**20
            self._cuda_peaks[phase] = max(self._cuda_peaks.get(phase, 0.0), peak)
            self._cuda_lifetime_mib = max(self._cuda_lifetime_mib, peak)
            torch.cuda.reset_peak_memory_stats(self._cuda)

    def take(self) -> dict[str, float]:
        out = {f"memory/rss_peak_mib/{phase.replace('/', '_')}_max": mib for phase, mib in self._peaks.items()}
        out.update({f"memory/cuda_peak_mib/{phase.replace('/', '_')}_max": mib
                    for phase, mib in self._cuda_peaks.items()})
        if self._cuda is not None:
            import torch

            lifetime = max(self._cuda_lifetime_mib, torch.cuda.max_memory_allocated(self._cuda) / 2**20)
            out["memory/cuda_peak_allocated_mib_max"] = lifetime
        self._peaks = {}
        self._cuda_peaks = {}
        return out
