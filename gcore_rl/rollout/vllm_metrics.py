"""What a vLLM server did, read from its Prometheus metrics (`GET /metrics`), as the `EngineStats` our own engine
keeps, so that dynamic placement's engine fit and the work counters see a vLLM engine as they see ours.

The server counts its engine steps (`vllm:iteration_tokens_total`, a histogram observed once per step), the
tokens it generated, the prompt tokens it was sent and those its prefix cache held, and finished requests; the
engine adds the seconds during which it had at least one request in flight (`BusyClock`). vLLM mixes prefills
into its decode steps and times none of them for us, so every step of a window counts as one decode round of
the window's mean batch (generated tokens / steps) and mean duration (busy seconds / steps): a fit over windows
of different batch sizes (`probe_rounds`' calls, a run's waves) separates a step's fixed cost from its cost
per sequence, though not as finely as our engine's per-round timings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gcore_rl.rollout.stats import EngineStats

COUNTERS = {
    "steps": "vllm:iteration_tokens_total_count",
    "generated": "vllm:generation_tokens_total",
    "prompt": "vllm:prompt_tokens_total",
    "cached": "vllm:prompt_tokens_cached_total",
    "requests": "vllm:request_success_total",
}
"""Our name → the Prometheus sample summed over its label sets (engines, finish reasons)."""


def metric_totals(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each named sample of a Prometheus text exposition (`name{labels} value` lines), summed over its label
    sets; 0 for a name that does not appear. Comments (`#`) and other samples are skipped."""
    wanted = set(names)
    totals = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line.split(" ", 1)[0]:  # name{labels} value [timestamp]; label values may hold spaces
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        if name in wanted:
            totals[name] += float(rest.split()[0])
    return totals


@dataclass(frozen=True)
class ServerCounts:
    """The server's counters at one moment (`COUNTERS`)."""

    steps: float = 0.0
    generated: float = 0.0
    prompt: float = 0.0
    cached: float = 0.0
    requests: float = 0.0

    @classmethod
    def parse(cls, text: str) -> ServerCounts:
        totals = metric_totals(text, COUNTERS.values())
        return cls(**{field: totals[name] for field, name in COUNTERS.items()})

    def since(self, earlier: ServerCounts) -> ServerCounts:
        """What was counted after `earlier`; everything, when a counter went back (a new server started since)."""
        delta = ServerCounts(**{f: getattr(self, f) - getattr(earlier, f) for f in COUNTERS})
        return self if any(getattr(delta, f) < 0 for f in COUNTERS) else delta


def window_stats(counts: ServerCounts, busy_s: float, longest: int, calls: int) -> EngineStats:
    """`EngineStats` of a window in which the server counted `counts` while it was busy `busy_s` seconds with
    `calls` generate calls whose longest completions sum to `longest` (see the module docstring)."""
    steps = int(counts.steps)
    generated = int(counts.generated)
    batch = round(generated / steps) if steps else 0
    cached = int(counts.cached)
    return EngineStats(decode_steps=steps, prefills=0, prefill_rows=int(counts.requests),
                       prefill_tokens=max(int(counts.prompt) - cached, 0), generated_tokens=generated,
                       sample_steps=steps, peak_batch=batch, round_batches=[batch] * steps,
                       round_seconds=[busy_s / max(steps, 1)] * steps, longest=longest, calls=calls, cached_tokens=cached)


class BusyClock:
    """Seconds during which at least one request was in flight (requests overlap: their union, not their sum),
    read from `clock`. Thread-safe: requests start and end on the engine's request threads."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._total = 0.0

    def start(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = self._clock()
            self._in_flight += 1

    def end(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._total += self._clock() - self._since

    def take(self) -> float:
        """The busy seconds since the last take (a request still in flight counts up to now)."""
        with self._lock:
            now = self._clock()
            total = self._total + (now - self._since if self._in_flight else 0.0)
            self._total = 0.0
            if self._in_flight:
                self._since = now
            return total
