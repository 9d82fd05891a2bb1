"""The spawn helper starts a group once more after a rank is killed by a signal, and only once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from process_helpers import run_processes


def _abort_first_time(rank: int, world: int, port: int, out_dir: str, always: bool) -> None:
    marker = Path(out_dir) / f"started-{rank}"
    if rank == 0 and (always or not marker.exists()):
        marker.touch()
        os.kill(os.getpid(), signal.SIGABRT)
    (Path(out_dir) / f"done-{rank}-{port}").touch()


def _raise(rank: int, world: int, port: int, out_dir: str) -> None:
    (Path(out_dir) / f"started-{rank}-{port}").touch()
    raise ValueError("a numbers bug")


def test_a_rank_killed_by_a_signal_gets_one_more_start_on_a_fresh_port(tmp_path):
    with pytest.warns(UserWarning, match="killed by SIGABRT"):
        run_processes(_abort_first_time, (str(tmp_path), False), 2, 60, "probe")
    assert len(list(tmp_path.glob("done-0-*"))) == 1


def test_a_second_signal_or_any_python_error_fails_at_once(tmp_path):
    with pytest.warns(UserWarning), pytest.raises(mp.ProcessExitedException):
        run_processes(_abort_first_time, (str(tmp_path), True), 2, 60, "probe")
    with pytest.raises(mp.ProcessRaisedException, match="a numbers bug"):
        run_processes(_raise, (str(tmp_path),), 2, 60, "probe")
    assert len({path.name.rsplit("-", 1)[1] for path in tmp_path.glob("started-*-*")}) == 1  # not started again
