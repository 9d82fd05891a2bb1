"""Out of memory, said in one paragraph: which role ran out, in which phase, on which device, and the settings
that would make it need less.

An allocation that fails raises `torch.OutOfMemoryError` on a GPU, `MemoryError` for Python's own objects,
and on a CPU torch's `RuntimeError` "DefaultCPUAllocator: can't allocate memory" (what a process limited by
`RLIMIT_AS` or a container's memory limit meets before the kernel's OOM killer). `naming(role, phase, device,
step)` turns any of them into an `OutOfMemory` error (a `GcoreError`: the run stops, checkpoints stay as they
were, and the driver does not restart it into the same failure). A process the kernel's OOM killer ends gets
SIGKILL and cannot say anything; its parent names the signal (`killed_by`).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

from gcore_rl.errors import OutOfMemory

SETTINGS = {
    "rollout": "engine.max_num_seqs (fewer sequences decoded at once, a smaller KV pool) or sampling.max_new_tokens",
    "judge": "judge.engine.max_num_seqs or judge.max_new_tokens",
    "reward_model": "reward_model.batch_size",
    "reference": "train.micro_batch_size or train.max_tokens_per_micro_batch",
    "actor": "train.micro_batch_size or train.max_tokens_per_micro_batch (fewer rows or tokens per pass), or "
             "train.activation_checkpointing=true",
    "critic": "train.micro_batch_size or train.max_tokens_per_micro_batch, or train.activation_checkpointing=true",
}
"""What reduces each role's memory, as the config keys a user sets."""

_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a failed allocation (see the module docstring)."""
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc).lower() for text in _MESSAGES)


@contextlib.contextmanager
def naming(role: str, phase: str, device: str, step: int) -> Iterator[None]:
    """Raise `OutOfMemory` naming `role`, `phase`, `device` and `step` instead of a failed allocation in the block."""
    try:
        yield
    except OutOfMemory:
        raise
    except Exception as exc:  # noqa: BLE001 - only a failed allocation is replaced
        if not is_out_of_memory(exc):
            raise
        detail = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise OutOfMemory(f"out of memory in the {role}'s {phase} on {device} in step {step} ({detail}). To need less, "
                          f"lower {SETTINGS.get(role, 'the batch sizes of this role')}. Every checkpoint written "
                          "before it is intact; continue with run.resume=auto.") from None


def driver_out_of_memory(exc: BaseException, command: str) -> str | None:
    """The paragraph for a failed allocation in the `gcore-rl` process itself (outside any role's phase, which
    `naming` covers), or None when `exc` is not one."""
    if not is_out_of_memory(exc):
        return None
    detail = " ".join(str(exc).split())[:160] or type(exc).__name__
    return (f"out of memory in the driver, the `gcore-rl {command}` process itself ({detail}). It holds the "
            "job's config, plan and records (and, in the local runtime, the controller and its device's models, "
            "whose phases are named on their own): lower run.prompts_per_step and sampling.n, or run the job "
            "with runtime.kind=ray so that the models live in processes of their own. Every checkpoint written "
            "before it is intact; continue with run.resume=auto.")


def killed_by(signum: int | None) -> str:
    """A clause for a process that ended by `signum`: SIGKILL is what the kernel's OOM killer sends (with the
    cgroup's `oom_kill` count when it is readable); "" for other endings."""
    if signum != signal.SIGKILL:
        return ""
    count = cgroup_oom_kills()
    seen = f"; this cgroup's memory.events counts {count} OOM kill(s)" if count else ""
    return (" It was killed by SIGKILL, which is how the kernel's out-of-memory killer ends a process"
            f"{seen}: if memory ran out, lower the batch sizes of the roles on that process.")


def cgroup_oom_kills(events: Path = Path("/sys/fs/cgroup/memory.events")) -> int | None:
    """The `oom_kill` count of this process's cgroup (v2), None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError):
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None
