"""The cluster path of docs/ray.md: a real head node started with `ray start` on loopback, joined by a job via the CLI.

The head node gets its own HOME holding a token in `~/.ray/auth_token`, so Ray 2.60 starts it with token
authentication, as it does on a machine where Ray has run before. Its session files live in a temp dir
of its own and every port it opens is a free one, so it cannot collide with another Ray on the machine.
`ray stop` would stop every Ray on the machine, so the teardown stops this cluster only: SIGTERM to the
blocking `ray start` (which stops the processes it started), then SIGKILL to whatever still names the
cluster's temp dir on its command line.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gcore_rl.distributed import free_port

pytestmark = pytest.mark.slow  # joining a Ray cluster: `make test-slow`

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
START_TIMEOUT_S = 90
JOB_TIMEOUT_S = 300
STOP_TIMEOUT_S = 30
SHORT_JOB = ["run.steps=1", "run.prompts_per_step=4", "sampling.n=2", "sampling.max_new_tokens=4",
             "data.num_prompts=16", "data.eval_prompts=4", "run.progress=false", "runtime.kind=ray",
             "runtime.controllers=2", "runtime.threads_per_process=1", "dynamic_sampling.enabled=false"]


def _env(home: Path) -> dict[str, str]:
    """This environment with `home` as HOME and no Ray auth or address settings inherited from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    return dict(env, HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")


def _cluster_pids(marker: str) -> list[int]:
    """Processes whose command line contains `marker` (the cluster's temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _stop(head: subprocess.Popen, marker: str) -> None:
    """Stop this cluster only: SIGTERM to `ray start --block`, then SIGKILL its group and what names `marker`."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(head.pid, signal.SIGKILL)  # `ray start` runs in a session (and group) of its own
    except ProcessLookupError:
        pass
    head.wait(timeout=STOP_TIMEOUT_S)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (left := [p for p in _cluster_pids(marker) if p != os.getpid()]) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def _wait_for_port(port: int, head: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert head.poll() is None, f"`ray start` exited with {head.returncode}:\n{log.read_text()}"
        if "Ray runtime started" in log.read_text(errors="replace"):
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                return
        time.sleep(0.5)
    raise AssertionError(f"the head node did not start within {START_TIMEOUT_S} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster with token authentication and 2 `device` slots: yields (address, HOME with its token)."""
    root = Path(tempfile.mkdtemp(prefix="gcr-ray-", dir="/tmp"))  # short: Ray's socket paths live under it
    home = root / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes
    port = free_port()
    ports = {f"--{name}": str(free_port()) for name in (
        "node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
        "runtime-env-agent-port", "metrics-export-port")}
    log = root / "ray-start.log"
    command = [str(RAY), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
               "--resources", '{"device": 2}', "--num-cpus=2", f"--temp-dir={root / 'ray'}",
               "--include-dashboard=false", "--disable-usage-stats", f"--object-store-memory={200 * 2**20}",
               *(f"{k}={v}" for k, v in ports.items())]
    with log.open("w") as out:
        head = subprocess.Popen(command, env=_env(home), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_port(port, head, log)
        assert "Token authentication is enabled" in log.read_text(errors="replace")
        yield f"127.0.0.1:{port}", home
    finally:
        _stop(head, str(root))
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "base"
    done = _cli("init-tiny", out, "hidden_size=32", "num_layers=2", "intermediate_size=64", cwd=out.parent,
                home=Path.home(), timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def _cli(*args: object, cwd: Path, home: Path, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gcore_rl.cli", *map(str, args)], cwd=cwd, env=_env(home),
                          capture_output=True, text=True, timeout=timeout)


def _train(address: str, model: Path, out: Path, home: Path) -> subprocess.CompletedProcess:
    return _cli("train", REPO / "recipes" / "grpo_addition.yaml", f"model.path={model}", f"run.output_dir={out}",
                f"runtime.ray_address={address}", *SHORT_JOB, cwd=out.parent, home=home)


def _assert_one_paragraph_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 1, no traceback, and an `error:` paragraph (no blank line in it) containing every needle."""
    detail = f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 1, detail
    assert "Traceback" not in done.stderr, detail
    message = done.stderr[done.stderr.index("error:"):].strip()
    assert "\n\n" not in message, detail
    flat = " ".join(message.split())  # the console may wrap long lines
    for needle in needles:
        assert needle in flat, detail


def test_a_job_joins_a_token_cluster_by_its_address(cluster, tiny_model, tmp_path):
    address, home = cluster
    # RAY_AUTH_MODE is not set (`_env` drops it): the job finds ~/.ray/auth_token and turns token mode on
    done = _train(address, tiny_model, tmp_path / "run", home)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "done: 1 steps" in done.stdout
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_a_job_without_the_token_is_refused_in_one_paragraph(cluster, tiny_model, tmp_path):
    address, _ = cluster
    stranger = tmp_path / "home"  # a HOME with no ~/.ray/auth_token
    stranger.mkdir()
    done = _train(address, tiny_model, tmp_path / "run", stranger)
    _assert_one_paragraph_error(done, "uses token authentication and refused this job", "found no token",
                                "ray get-auth-token")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_address_where_no_cluster_runs_is_reported_in_one_paragraph(tiny_model, tmp_path):
    closed = free_port()  # bound, then released: nothing listens there
    done = _train(f"127.0.0.1:{closed}", tiny_model, tmp_path / "run", Path.home())
    _assert_one_paragraph_error(done, "no Ray cluster answers at", f":{closed}", "ray start --head")
