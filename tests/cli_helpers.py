"""Running the `gcore-rl` command line in a process of its own and judging what a user would see.

Each call runs the CLI in a fresh process, as a user's shell would, but forked from a server process that
has imported the CLI and what every command imports first, torch and transformers (`PRELOAD`), once
(`multiprocessing`'s forkserver, which never runs a torch op, so no thread pool is forked): a call then
costs the command's own work, not ~3 s of imports, and the suite makes some 160 of them. The child gets the call's working directory,
environment and `sys.path`, writes stdout and stderr to files through file descriptors 1 and 2, and ends
with the command's exit status (a signal, e.g. an injected SIGKILL, as a negative status), exactly what
`subprocess.run` reported. `GCORE_TEST_CLI_SUBPROCESS=1` runs `python -m gcore_rl.cli` instead.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_addition.yaml"
# a short job: 4 prompts x 4 samples, one wave per step (the demo recipe's dynamic sampling would keep
# drawing waves for a random model whose rewards are all equal), 1 intra-op thread (the tiny model
# gains nothing from more); the demo recipe stops on held-out accuracy, runs without held-out
# prompts switch that off
NO_STOP = "run.stop_at_eval_accuracy=0"
SHORT = ["run.prompts_per_step=4", "sampling.n=4", "run.progress=false", "runtime.threads_per_process=1",
         "dynamic_sampling.enabled=false"]
TIMEOUT_S = 120
TINY_SHAPE = ["hidden_size=32", "num_layers=2", "intermediate_size=64"]
"""`init-tiny` options of the small model the CLI tests share."""


def gcore_rl(*args: object, cwd: Path, extra_pythonpath: Path | None = None,
             fault: str | None = None) -> subprocess.CompletedProcess:
    """`gcore-rl ARGS` in `cwd`, offline, one thread; `extra_pythonpath` is importable (reward modules);
    `fault` ("phase:step", `gcore_rl.faults`) kills the run with SIGKILL at that moment."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if extra_pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_pythonpath), env.get("PYTHONPATH")) if p)
    env.pop("GCORE_FAULT", None)
    if fault is not None:
        env["GCORE_FAULT"] = fault
    argv = [str(a) for a in args]
    if os.environ.get("GCORE_TEST_CLI_SUBPROCESS") == "1":
        return subprocess.run([sys.executable, "-m", "gcore_rl.cli", *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="gcore-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = forkserver().Process(target=_run_cli, args=(argv, str(cwd), env, extra_pythonpath, str(out), str(err)))
        child.start()
        child.join(TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["gcore-rl", *argv], TIMEOUT_S, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(["gcore-rl", *argv], child.exitcode, out.read_text(), err.read_text())


_CONTEXT: multiprocessing.context.BaseContext | None = None
#: what the forkserver imports before it forks any call: `gcore_rl.cli` imports its commands lazily, and every
#: command starts with `gcore_rl.models.loading` (torch + transformers, 2.7 s on the 2-core machine); the
#: driver adds the trainer's modules, textarena (when installed: 2.4 s) the environment tasks' games, and the
#: diffusion commands' modules with the diffusers modules they reach through `diffusers`' lazy attributes (1.6 s
#: per call otherwise; the suite makes some 30), and `datasets`, which reading a prompt file imports (0.5 s). None of them starts a thread or imports Ray at import time; forkserver skips a
#: preload that does not import.
PRELOAD = ["gcore_rl.cli", "gcore_rl.models.loading", "gcore_rl.runtime.driver", "textarena", "gcore_rl.runtime.kinds",
           "gcore_rl.runtime.image_worker", "gcore_rl.diffusion.samples",
           "gcore_rl.diffusion.config", "gcore_rl.models.tiny", "datasets",
           "diffusers.models.transformers.transformer_sd3", "diffusers.models.transformers.transformer_flux",
           "diffusers.models.autoencoders.autoencoder_kl", "diffusers.schedulers.scheduling_flow_match_euler_discrete"]


def forkserver() -> multiprocessing.context.BaseContext:
    """The forkserver context whose server has imported the CLI and the trainer (`PRELOAD`); started (with the
    offline, one-thread environment every call uses) at the first call. The multi-process trainer tests fork
    their ranks from it too (`process_helpers.run_processes`)."""
    global _CONTEXT
    if _CONTEXT is None:
        os.environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")  # read at import time by the preloaded libraries
        _CONTEXT = multiprocessing.get_context("forkserver")
        _stop_a_server_started_before()
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _stop_a_server_started_before() -> None:
    """multiprocessing keeps one forkserver per process. A test that used it before the first CLI call (the
    reward pool, `gcore_rl.rewards.pool`, forks its workers from it) started it without `PRELOAD` and without
    the environment above, and every call forked from it would import torch again (~3 s each: a suite
    order that ran a reward-pool test first took 1450 s instead of 850-890 s). Stop it; the next start,
    ours, preloads. A pool still open would start new workers from that server, which suits them too.

    The server is killed, not asked to stop: it stops when the pipe it watches reaches end-of-file, which
    never happens while a process forked from this one still holds the pipe's other end (an order of the
    suite hung here for good)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the process-wide server (private, but stable since Python 3.4)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with server._lock:
        os.close(server._forkserver_alive_fd)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with contextlib.suppress(OSError, TypeError):  # an abstract socket name is no file
            os.unlink(server._forkserver_address)
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None


def _run_cli(argv: list[str], cwd: str, env: dict[str, str], extra_pythonpath: Path | None, out: str, err: str) -> None:
    """In the forked child: the CLI with `argv` in `cwd` and `env`, its output in the files `out` and `err`;
    ends the process with the command's exit status, as the interpreter would."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if extra_pythonpath is not None:
        sys.path.insert(0, str(extra_pythonpath))
    sys.argv = ["gcore-rl", *argv]
    from gcore_rl.cli import main

    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def squeeze(text: str) -> str:
    """`text` without any whitespace.

    The CLI's rich console hard-wraps stderr at 80 columns when it is not a terminal, turning a
    space into a line break or splitting a long path in the middle, so messages are compared with
    all whitespace removed.
    """
    return "".join(text.split())


def assert_user_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """Exit status `code`, every needle in stderr, and no Python traceback."""
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == code, detail
    message = squeeze(proc.stderr)
    for needle in needles:
        assert squeeze(needle) in message, detail
    assert "Traceback" not in proc.stderr, detail


def init_tiny(workdir: Path) -> Path:
    """`workdir/tiny`: a small model written by the real `init-tiny` command."""
    proc = gcore_rl("init-tiny", "tiny", *TINY_SHAPE, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "tiny" in proc.stdout
    return workdir / "tiny"


def _subprocess_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))


def terminate_after(args: list[str], out: Path, step: int) -> subprocess.CompletedProcess:
    """Run `args` (a command line, in the repository) and send it SIGTERM once `out`'s record of `step` is written (the
    step's line of metrics.jsonl); wait for the process."""
    proc = subprocess.Popen(args, cwd=REPO, env=_subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
