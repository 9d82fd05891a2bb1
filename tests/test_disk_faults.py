"""A full or read-only disk, as a user meets it: one paragraph naming the path and the room there, a non-zero
exit, every earlier checkpoint intact and taken by `run.resume=auto`.

The decision (`gcore_rl/disk.py`) is tested on the errors the writes raise, including DCP's wrapping of
`torch.save`'s short write, which carries no errno; the command line with an injected ENOSPC
(`GCORE_FAULT=nospace-save:N`) and, where this process may mount one (root), with a real small tmpfs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_helpers import NO_STOP, RECIPE, SHORT, assert_user_error, gcore_rl, init_tiny

from gcore_rl.checkpoint.manifest import verify
from gcore_rl.disk import LOW_BYTES, disk_error, writing
from gcore_rl.errors import DiskError


class WrappedFailures(BaseException):
    """Like DCP's `CheckpointException`: a BaseException whose `failures` map ranks to (exception, traceback)."""

    def __init__(self, failures):
        super().__init__("CheckpointException ranks:dict_keys([0])")
        self.failures = failures


def test_no_space_names_the_path_the_room_and_what_to_do(tmp_path):
    error = disk_error(tmp_path / "ckpt", "the checkpoint", OSError(errno.ENOSPC, "No space left on device"), 12345)
    assert isinstance(error, DiskError)
    text = str(error)
    assert f"'{tmp_path / 'ckpt'}'" in text and "the disk is full" in text and "bytes are free there" in text
    assert "12,345 bytes" in text and "run.resume=auto" in text


def test_a_read_only_folder_is_named_as_not_writable(tmp_path):
    text = str(disk_error(tmp_path, "the run's records", OSError(errno.EROFS, "Read-only file system")))
    assert "not writable" in text and "EROFS" in text


def test_a_short_write_without_errno_is_the_disks_fault_only_when_the_disk_has_no_room(tmp_path):
    short = WrappedFailures({0: (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                                 "traceback")})
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert free > LOW_BYTES
    assert disk_error(tmp_path, "the checkpoint", short, needed=1000) is None  # room enough: not the disk
    assert isinstance(disk_error(tmp_path, "the checkpoint", short, needed=free * 2), DiskError)
    chained = WrappedFailures({0: (OSError(errno.ENOSPC, "No space left on device"), "traceback")})
    assert "the disk is full" in str(disk_error(tmp_path, "the checkpoint", chained))


def test_writing_replaces_only_the_disks_failures(tmp_path):
    with pytest.raises(DiskError, match="the disk is full"), writing(tmp_path, "a file"):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(ValueError), writing(tmp_path, "a file"):
        raise ValueError("not about the disk")
    with pytest.raises(KeyboardInterrupt), writing(tmp_path, "a file"):
        raise KeyboardInterrupt


def train(workdir: Path, tiny: Path, out: Path, steps: int, *extra: str, fault: str | None = None):
    return gcore_rl("train", RECIPE, f"model.path={tiny}", f"run.output_dir={out}", f"run.steps={steps}",
                    "run.checkpoint_every=1", "data.eval_prompts=0", NO_STOP, "run.save_final=false", *SHORT, *extra,
                    cwd=workdir, fault=fault)


def fingerprint(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def steps_recorded(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("disk"))


def test_a_save_that_finds_the_disk_full_stops_the_run_and_loses_nothing(tiny, tmp_path):
    out = tmp_path / "run"
    proc = train(tmp_path, tiny, out, 3, fault="nospace-save:2")
    assert_user_error(proc, 1, "could not write the checkpoint", "step-00000002.incomplete", "the disk is full",
                      "run.resume=auto")
    first = out / "checkpoints" / "step-00000001"
    verify(first)  # the save before the failure is complete and listed
    assert not (out / "checkpoints" / "step-00000002.incomplete").exists()  # its partial folder is gone
    before = fingerprint(first)
    resumed = train(tmp_path, tiny, out, 3, "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "step-00000001" in resumed.stdout + resumed.stderr  # resumed from the complete one
    assert steps_recorded(out) == [1, 2, 3]
    assert fingerprint(first) == before or not first.exists()  # untouched (or pruned once newer ones exist)


def _mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    return os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                                capture_output=True).returncode == 0


@pytest.mark.parametrize("write", ["blocking", "background"])
def test_a_real_full_tmpfs_is_named_and_a_resume_after_making_room_finishes(tiny, tmp_path, write):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "500k"):  # one checkpoint of the tiny model (~330 kB) fits, two do not
        pytest.skip("mounting a tmpfs needs root")
    try:
        out, checkpoints = tmp_path / "run", disk / "checkpoints"
        proc = train(tmp_path, tiny, out, 3, f"run.checkpoint_dir={checkpoints}", f"run.checkpoint_write={write}")
        assert_user_error(proc, 1, "the disk is full", str(checkpoints), "bytes are free there")
        complete = sorted(p for p in checkpoints.iterdir() if not p.name.endswith(".incomplete"))
        assert complete, f"the first save fits; {sorted(p.name for p in checkpoints.iterdir())}: {proc.stderr}"
        verify(complete[-1])
        saved = fingerprint(complete[-1])
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = train(tmp_path, tiny, out, 3, f"run.checkpoint_dir={checkpoints}", "run.resume=auto")
        assert resumed.returncode == 0, resumed.stderr
        assert steps_recorded(out) == [1, 2, 3]
        assert not complete[-1].exists() or fingerprint(complete[-1]) == saved
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
