"""One vLLM server process per engine: its settings, start-up, HTTP calls and shutdown.

The server runs vLLM's OpenAI-compatible API from the environment `VllmConfig.python` names (built by
`make vllm-env`), bound to 127.0.0.1 on a free port, started through `vllm_launch.py` so that it dies with
the process that owns it. Start-up waits for `GET /health` (up to `startup_timeout_s`); a server that
exits first, or never answers, is an `EngineStartError` quoting the last lines of its log. It is started
with `VLLM_SERVER_DEV_MODE=1` for the endpoints a trainer needs beside generation: `/collective_rpc`
(`reload_weights` from a folder of safetensors), `/reset_prefix_cache`, `/sleep` and `/wake_up`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from gcore_rl.errors import ConfigError, GcoreError

LAUNCHER = Path(__file__).with_name("vllm_launch.py")
SERVED_NAME = "policy"
"""The model name the server answers to (`--served-model-name`)."""
DEFAULT_PYTHON = ".venv-vllm/bin/python"
WEIGHT_SYNCS = ("file", "group")
EXTENSION_DIR = Path(__file__).with_name("vllm_ext")
EXTENSION = "gcore_vllm_worker.WorkerExtension"
"""The worker extension every server loads, imported by vLLM's workers from `EXTENSION_DIR`: `weight_sync=group`'s
receiving side, and log-probs before top-k / top-p (`gcore_vllm_sampler`)."""
LOG_TAIL_LINES = 25


class EngineStartError(GcoreError):
    """The vLLM server could not be started (environment missing or broken, model refused, no answer)."""


@dataclass
class VllmConfig:
    """Where vLLM comes from and how its server runs (`engine.backend=vllm`)."""

    python: str = field(default=DEFAULT_PYTHON, metadata={"help": "The Python of the environment vLLM is installed in (`make vllm-env` builds .venv-vllm); a relative path is taken from the current directory, else from the gcore-rl checkout."})
    startup_timeout_s: float = field(default=300.0, metadata={"help": "Seconds the server may take to load the model and answer /health (40-60 s for a tiny model on 2 CPU cores)."})
    max_model_len: int = field(default=0, metadata={"help": "The server's longest sequence (prompt + completion); 0 = the model's max_position_embeddings."})
    kv_cache_gib: float = field(default=1.0, metadata={"help": "CPU only: the KV cache's size in GiB (VLLM_CPU_KVCACHE_SPACE)."})
    gpu_memory_utilization: float = field(default=0.5, metadata={"help": "CUDA only: the share of the GPU's memory vLLM may take (weights, activations, KV cache)."})
    threads: int = field(default=0, metadata={"help": "CPU only: threads the server computes with (0 = runtime.threads_per_process)."})
    weight_sync: str = field(default="file", metadata={"help": "How an update reaches the server: 'file' (written as safetensors to /dev/shm and reloaded by the server) or 'group' (broadcast from the engine's process to the server's workers over a gloo process group of their own, and reloaded in place; no file)."})
    extra_args: list[str] = field(default_factory=list, metadata={"help": "More arguments for vLLM's server (e.g. ['--enable-prefix-caching'])."})

    def validate(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ConfigError("startup_timeout_s", f"must be > 0, got {self.startup_timeout_s}")
        if self.max_model_len < 0:
            raise ConfigError("max_model_len", f"must be >= 0 (0 = the model's), got {self.max_model_len}")
        if self.kv_cache_gib <= 0:
            raise ConfigError("kv_cache_gib", f"must be > 0, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.threads < 0:
            raise ConfigError("threads", f"must be >= 0 (0 = runtime.threads_per_process), got {self.threads}")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ConfigError("weight_sync", f"must be one of {', '.join(WEIGHT_SYNCS)}, got '{self.weight_sync}'")

    def python_path(self) -> Path:
        """`python` as an absolute path: a relative one from the current directory if it exists there, else from
        the checkout gcore-rl runs from (where `make vllm-env` puts .venv-vllm), so a job started elsewhere, or
        a Ray worker with another working directory, finds the same environment."""
        path = Path(self.python).expanduser()
        if path.is_absolute() or path.exists():
            return path.absolute()
        checkout = Path(__file__).resolve().parents[2] / path
        return checkout if checkout.exists() else path.absolute()


def vllm_missing(cfg: VllmConfig) -> str | None:
    """Why the vLLM environment cannot be used (a sentence about `cfg.python`, to follow its config key), or
    None when its Python finds the vllm package. Found, not imported (importing vLLM takes seconds, and this runs
    before every attempt of a job and in every worker): an installation that is there but broken says so in
    the server's log at start-up (`EngineStartError`)."""
    python = cfg.python_path()
    if not python.exists():
        return (f"'{cfg.python}' does not exist: build the vLLM environment with `make vllm-env` (or name the "
                "Python of an environment where vLLM is installed)")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no module named 'vllm'"])[-1]
        return f"'{cfg.python}' cannot import vllm ({last}); rebuild the environment with `make vllm-env`"
    return None


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` (Linux: /proc/<pid>/stat)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp
            members.append(int(stat.parent.name))
    return members


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class VllmServer:
    """A running vLLM server for the model folder `model_path` (see the module docstring)."""

    def __init__(self, cfg: VllmConfig, model_path: str, dtype: str, device_type: str, seed: int, log_path: Path,
                 threads: int = 1, max_num_seqs: int = 256):
        problem = vllm_missing(cfg)
        if problem is not None:
            raise EngineStartError(f"engine.vllm.python {problem}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = ["--model", model_path, "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                "--port", str(self.port), "--dtype", dtype, "--seed", str(seed), "--enforce-eager",
                "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log", "--max-logprobs", "1",
                "--max-num-seqs", str(max_num_seqs)]
        if cfg.max_model_len:
            args += ["--max-model-len", str(cfg.max_model_len)]
        if device_type == "cuda":
            args += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization), "--enable-sleep-mode"]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(max(1, round(cfg.kv_cache_gib))),
                   VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(cfg.threads or threads),
                   OMP_WAIT_POLICY="PASSIVE", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        args += ["--worker-extension-cls", EXTENSION]
        # the trainer's packages must not shadow the vLLM environment's: only the extension's folder, which imports
        # only torch
        env["PYTHONPATH"] = str(EXTENSION_DIR)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        self.process = subprocess.Popen([str(cfg.python_path()), str(LAUNCHER), str(os.getpid()), "--", *args,
                                         *cfg.extra_args], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        self._wait_ready(cfg.startup_timeout_s)
        self.untruncated_logprobs = self._untruncate()

    def _untruncate(self) -> str:
        """Ask the workers to report log-probs before top-k / top-p (`gcore_vllm_sampler`); "" once they all do,
        otherwise the first worker's reason (the log-probs of truncated sampling then come renormalised)."""
        try:
            results = self.post("/collective_rpc", {"method": "gcore_untruncated_logprobs"}).get("results", [])
        except ServerError as error:
            return str(error).splitlines()[0]
        return next((str(r) for r in results if r), "" if results else "no worker answered")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise EngineStartError(f"the vLLM server exited with status {self.process.returncode} while starting; "
                                       f"the end of its log ({self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineStartError(f"the vLLM server did not answer /health within engine.vllm.startup_timeout_s="
                               f"{timeout_s:g} s; the end of its log ({self.log_path}):\n{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def get_text(self, path: str, timeout_s: float = 30.0) -> str:
        """GET `path` (the metrics); its text. A server that does not answer raises `ServerError`."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout_s) as answer:
                return answer.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            raise ServerError(f"vLLM server {path}: {error}") from None

    def post(self, path: str, body: dict | None = None, timeout_s: float = 3600.0) -> dict:
        """POST `body` as JSON to `path`; the JSON answer ({} when empty). A server that died or answers with
        an error status raises `ServerError` with its message."""
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                text = answer.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            raise ServerError(f"vLLM server {path} answered {error.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            state = "exited" if self.process.poll() is not None else "did not answer"
            raise ServerError(f"vLLM server {path}: the server {state} ({error}); the end of its log "
                              f"({self.log_path}):\n{self.log_tail()}") from None
        return json.loads(text) if text.strip() else {}

    def pause(self) -> None:
        """Stop the processes the server started (SIGSTOP: they hold their memory but use no CPU), all but the
        first, whose thread watching the owner must stay able to end the group (`vllm_launch.py`)."""
        for pid in group_members(self.process.pid):
            if pid != self.process.pid:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass

    def resume(self) -> None:
        """Let paused processes run again (SIGCONT)."""
        self._signal(signal.SIGCONT)

    def _signal(self, which: signal.Signals) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, which)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """End the server and every process it started (its process group)."""
        if self.process.poll() is None:
            self.resume()  # a paused server cannot act on SIGTERM
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait()
        self._log.close()


class ServerError(RuntimeError):
    """A request to the vLLM server failed (the server died, or refused the request)."""
