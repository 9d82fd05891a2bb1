"""The spawn helper fails a test at once when a rank is killed by a signal or raises, starting nothing again."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from process_helpers import run_processes


def _abort_rank_0(rank: int, world: int, port: int, out_dir: str) -> None:
    (Path(out_dir) / f"started-{rank}-{port}").touch()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGABRT)


def _raise(rank: int, world: int, port: int, out_dir: str) -> None:
    (Path(out_dir) / f"started-{rank}-{port}").touch()
    raise ValueError("a numbers bug")


def _finish(rank: int, world: int, port: int, out_dir: str) -> None:
    (Path(out_dir) / f"done-{rank}").touch()


def test_a_rank_killed_by_a_signal_fails_the_test_naming_it(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="rank 0 of 2 was killed by SIGABRT"):
        run_processes(_abort_rank_0, (str(tmp_path),), 2, 60, "probe")
    assert len({path.name.rsplit("-", 1)[1] for path in tmp_path.glob("started-*-*")}) == 1  # not started again


def test_a_python_error_fails_with_its_traceback_and_finished_ranks_exit_0(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="a numbers bug"):
        run_processes(_raise, (str(tmp_path),), 2, 60, "probe")
    run_processes(_finish, (str(tmp_path),), 2, 60, "probe")  # ends by `end_process(0)`: status 0
    assert sorted(path.name for path in tmp_path.glob("done-*")) == ["done-0", "done-1"]
