"""Error types that the command line shows to users as a single paragraph.

Anything derived from `GcoreError` is an expected, user-facing failure (a bad config value, an
unreadable data file, a reward function that misbehaves, a model that cannot be loaded). The CLI
prints its message and exits with a non-zero status instead of dumping a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable


class GcoreError(Exception):
    """Base of errors shown to users as one paragraph (CLI exits non-zero)."""


class ConfigError(GcoreError):
    """An impossible or unusable configuration value.

    `key` is the field name relative to the dataclass that raised it; the config loader prepends
    the dotted path of the enclosing sections with `with_prefix`, so the final message names the
    key exactly as the user wrote it (e.g. ``data.num_prompts``).
    """

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"config key `{key}`: {message}")

    def __reduce__(self):
        # rebuilt from (key, message) when it crosses a process boundary (spawned controllers, Ray actors)
        return type(self), (self.key, self.message)

    def with_prefix(self, prefix: str) -> ConfigError:
        """Return a copy whose key is `prefix.key` (unchanged when `prefix` is empty)."""
        return ConfigError(f"{prefix}.{self.key}" if prefix else self.key, self.message)


def did_you_mean(name: str, names: Iterable[str], spell: Callable[[str], str] = "`{}`".format) -> str:
    """``did you mean `a`?`` (or ```a` or `b```) for the valid `names` nearest to a misspelt `name`
    (`difflib.get_close_matches`, at most three), each written by `spell`; "" when none is near."""
    near = [spell(match) for match in difflib.get_close_matches(name, list(names), n=3)]
    if not near:
        return ""
    return "did you mean " + (near[0] if len(near) == 1 else ", ".join(near[:-1]) + " or " + near[-1]) + "?"


class DataError(GcoreError):
    """Prompt data could not be found, read, or has rows of the wrong shape."""


class RewardError(GcoreError):
    """A reward function failed or returned something that is not a finite number."""


class ModelLoadError(GcoreError):
    """A model or tokenizer could not be loaded from the given location."""


class CheckpointError(GcoreError):
    """A checkpoint is incomplete, damaged, or does not fit the job that tries to resume from it."""


class RunDirError(GcoreError):
    """A path given as a run's output directory is not a directory or holds no records of a run."""


class ProcessFailure(GcoreError):
    """A process of the job died (a controller, a device worker, a Ray actor) or the job stopped making
    progress (a hang the watchdog detected): a failure of the machinery, not of the config or data,
    so the driver may restart the job from its newest complete checkpoint (`run.max_restarts`)."""


class RolloutError(GcoreError):
    """A rollout function (`rollout.function`) failed or returned completions that break its contract."""


class DiskError(GcoreError):
    """A file of the run could not be written: the disk is full, or the folder is not writable (`gcore_rl.disk`)."""


class TargetNotReached(GcoreError):
    """A training stage (SFT, a reward model) hit its step cap before its held-out target; what it trained is saved,
    and the error names both, so a pipeline never goes on from a weaker stage than it asked for."""


EXIT_PREEMPTED = 143
"""128 + SIGTERM: the status a process ended by SIGTERM reports, which schedulers read as 'preempted'."""


class Preempted(GcoreError):
    """The run stopped at a step boundary after SIGTERM, its checkpoint complete (exit status 143;
    `gcore_rl.controller.preemption`). Never restarted by the driver."""


class OutOfMemory(GcoreError):
    """A role ran out of memory (`gcore_rl.oom`): named with its phase, device and the settings that reduce it.
    Not restarted by the driver: a restart would run into the same failure."""
