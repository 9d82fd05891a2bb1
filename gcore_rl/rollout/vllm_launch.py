"""Start vLLM's OpenAI-compatible server so that it never outlives the process that started it.

Run by the vLLM environment's Python (`engine.vllm.python`), by path, not as a package module: it imports
nothing of `gcore_rl`, whose dependencies that environment need not have. A thread watches the parent
(the device worker that owns the engine): once it is gone (killed, crashed, ended without closing the
engine), this process's group — the server and the engine processes vLLM forks — is killed, so an orphaned
server never holds its port and memory after the job. `PR_SET_PDEATHSIG` is not used: it fires when the
parent *thread* that forked ends, and workers may start engines from short-lived threads.

    python vllm_launch.py PARENT_PID -- [vllm server arguments]
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
POLL_S = 1.0


def _watch(parent: int) -> None:
    """Kill this process group once `parent` is no longer this process's parent."""
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            os.killpg(os.getpgrp(), signal.SIGKILL)


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit("usage: vllm_launch.py PARENT_PID -- [vllm server arguments]")
    parent = int(sys.argv[1])
    if os.getppid() != parent:  # the parent died before this line
        raise SystemExit(1)
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="parent-watch").start()
    sys.argv = [SERVER_MODULE, *sys.argv[3:]]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
