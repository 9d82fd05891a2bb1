"""gloo's teardown abort (issue 45, part 5): how often a rank of a 2-process gloo group dies at its end with
SIGABRT ("terminate called without an active exception"), by the way the process ends.

**Question.** A rank that has finished its work and torn its process group down sometimes aborted in CI
(twice in the full suite on 2 busy cores, once in `test_local_two_controllers` after all 3 steps). Which
way of ending a process that owns a gloo group aborts, and does the way `gcore_rl.distributed` ends
processes now (`end_process`) abort in ≥ 500 teardowns under a CPU hog?

**Setup.** `--pairs` pairs of processes, `--jobs` pairs at a time, each pair a gloo group of 2 made by
`gcore_rl.distributed.init_process_group` on a fresh port, one torch thread per process. Each rank does
what a trainer rank does to the group in a step: `all_reduce` of a 4096-float tensor, `all_gather` of it,
`all_reduce_mean` of a metrics dict, a barrier; with `--checkpoint-group` also what the background
checkpointer does (`training/trainer_checkpoint.py`): a second gloo group from `new_group`, a barrier on it
from a `ThreadPoolExecutor` thread, the group destroyed and the pool shut down; with `--fsdp` also what
the trainer does: a 2-layer model sharded by FSDP2 over the group, one forward and backward, the model kept
to the process's end (its device mesh holds the group, so `destroy_process_group` does not free it and its
C++ teardown runs in the interpreter's finalisation). Then it ends by `--ending`:

- `destroy`: `dist.destroy_process_group()`, then the interpreter's own exit (atexit, module teardown,
  static destructors): how tests, local device workers and Ray actors ended before this issue;
- `keep`: no destroy; the interpreter's exit destroys the group (during finalisation);
- `pending`: an `all_reduce(async_op=True)` left unwaited, then `destroy` (a rank that ends with a
  collective in flight, the shape of PyTorch's report of this abort);
- `end`: `gcore_rl.distributed.end_process(0)`: barrier, destroy, flush, `os._exit` (what every process
  that owns a group does now).

A process is started by `--start fork` (a fork of this script after `import torch`, which then runs and
exits as a normal Python program: cheap, ~0.1 CPU-s a rank) or `exec` (a fresh interpreter, like the
`spawn` start method: ~2 CPU-s a rank). `--hog N` runs N busy-loop processes for the whole run. Counted
per rank: its exit status (0, -6 = SIGABRT, other) and whether its stderr has "terminate called"; a pair
that runs past `--timeout-s` is killed and counted as a hang.

    nice -n 10 .venv/bin/python benchmarks/gloo_teardown.py --pairs 250 --jobs 2 --hog 1 --ending destroy
    nice -n 10 .venv/bin/python benchmarks/gloo_teardown.py --pairs 250 --jobs 2 --hog 1 --ending end

prints one line per 50 pairs and then one JSON object: the counts (`exit_0`, `sigabrt`, `other`,
`terminate_called`, `hangs`), the settings, and the stderr of the first few failed ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402  (imported once here so forked ranks start warm)
import torch.distributed as dist  # noqa: E402
import torch.distributed.fsdp  # noqa: E402, F401  (warm for --fsdp)

from gcore_rl.distributed import (  # noqa: E402
    all_reduce_mean,
    barrier,
    destroy_process_group,
    end_process,
    free_port,
    init_process_group,
)

ENDINGS = ("destroy", "keep", "pending", "end")
_HELD: list = []  # what a rank keeps to its end, as a trainer keeps its FSDP model


def rank_main(rank: int, port: int, ending: str, checkpoint_group: bool, fsdp: bool = False) -> None:
    """One rank's work on the group, then its ending (returns only for the endings that exit normally)."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    init_process_group(rank, 2, port, cpu)
    tensor = torch.full((4096,), float(rank + 1))
    dist.all_reduce(tensor)
    gathered = [torch.empty_like(tensor) for _ in range(2)]
    dist.all_gather(gathered, tensor)
    all_reduce_mean({"loss": float(rank), "grad_norm_max": 1.0}, cpu)
    barrier()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        model(torch.randn(8, 64)).sum().backward()  # all-gathers and a reduce-scatter over the group
        _HELD.append(model)  # its mesh keeps the group object alive past `destroy_process_group`
    if checkpoint_group:
        from concurrent.futures import ThreadPoolExecutor

        group = dist.new_group(backend="gloo")
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        writer.submit(dist.barrier, group=group).result()
        writer.shutdown()
        dist.destroy_process_group(group)
    if ending == "end":
        end_process(0)
    if ending == "pending":
        dist.all_reduce(torch.ones(1 << 16), async_op=True)  # left unwaited
    if ending in ("destroy", "pending"):
        destroy_process_group()


def _fork_rank(rank: int, port: int, args: argparse.Namespace, log: Path) -> int:
    """Fork a rank that, in the child, runs `rank_main` and then exits as a normal Python program would."""
    pid = os.fork()
    if pid:
        return pid
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    os.close(fd)
    code = 0
    try:
        rank_main(rank, port, args.ending, args.checkpoint_group, args.fsdp)
    except BaseException as exc:  # noqa: BLE001 - the child reports anything through its status
        import traceback

        traceback.print_exc()
        code = 1 if not isinstance(exc, SystemExit) else exc.code
    raise _ChildExit(code)


class _ChildExit(BaseException):
    """Unwinds a forked rank to the top of the script, which exits with its code through the interpreter."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _exec_rank(rank: int, port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    command = [sys.executable, __file__, "--rank", str(rank), "--port", str(port), "--ending", args.ending]
    command += ["--checkpoint-group"] * args.checkpoint_group + ["--fsdp"] * args.fsdp
    with open(log, "w") as stream:
        return subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT)


class Pair:
    """Two ranks of one group, started together; `poll` returns their statuses once both ended."""

    def __init__(self, args: argparse.Namespace, folder: Path, index: int):
        port = free_port()
        self.logs = [folder / f"pair{index}-rank{rank}.log" for rank in range(2)]
        self.started = time.monotonic()
        if args.start == "fork":
            self.pids = [_fork_rank(rank, port, args, self.logs[rank]) for rank in range(2)]
        else:
            self.pids = [_exec_rank(rank, port, args, self.logs[rank]).pid for rank in range(2)]
        self.statuses: dict[int, int] = {}

    def poll(self, timeout_s: float) -> list[int | None] | None:
        for pid in self.pids:
            if pid not in self.statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.statuses[pid] = os.waitstatus_to_exitcode(status)
        if len(self.statuses) == 2:
            return [self.statuses[pid] for pid in self.pids]
        if time.monotonic() - self.started > timeout_s:
            for pid in self.pids:
                if pid not in self.statuses:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            return [self.statuses.get(pid) for pid in self.pids]  # None: hung
        return None


def run(args: argparse.Namespace) -> dict:
    """Run the pairs and count how their ranks ended. (A forked rank leaves this function by `_ChildExit`,
    so the clean-up below runs in this process only.)"""
    parent = os.getpid()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    folder = Path(tempfile.mkdtemp(prefix="gloo-teardown-"))
    counts: Counter = Counter()
    failures: list[str] = []
    started = time.monotonic()
    try:
        running: list[Pair] = []
        launched = finished = 0
        while finished < args.pairs:
            while launched < args.pairs and len(running) < args.jobs:
                running.append(Pair(args, folder, launched))
                launched += 1
            time.sleep(0.02)
            for pair in list(running):
                statuses = pair.poll(args.timeout_s)
                if statuses is None:
                    continue
                running.remove(pair)
                finished += 1
                _count(pair, statuses, counts, failures)
                if finished % 50 == 0:
                    print(f"{finished} pairs, {time.monotonic() - started:.0f} s: {dict(counts)}", flush=True)
    finally:
        if os.getpid() == parent:
            for hog in hogs:
                hog.kill()
                hog.wait()
            shutil.rmtree(folder, ignore_errors=True)
    return {"ending": args.ending, "start": args.start, "checkpoint_group": args.checkpoint_group, "fsdp": args.fsdp,
            "pairs": args.pairs, "teardowns": 2 * args.pairs, "hog": args.hog, "jobs": args.jobs,
            "seconds": round(time.monotonic() - started, 1), **{k: counts[k] for k in
            ("exit_0", "sigabrt", "other", "terminate_called", "hangs")}, "failures": failures[:5]}


def _count(pair: Pair, statuses: list[int | None], counts: Counter, failures: list[str]) -> None:
    for log, status in zip(pair.logs, statuses, strict=True):
        text = log.read_text(errors="replace")
        counts["terminate_called"] += "terminate called" in text
        key = "hangs" if status is None else "exit_0" if status == 0 else "sigabrt" if status == -6 else "other"
        counts[key] += 1
        if key != "exit_0":
            failures.append(f"{log.name}: status {status}: {text[-1500:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=250, help="groups of 2 to start and end")
    parser.add_argument("--jobs", type=int, default=2, help="pairs running at a time")
    parser.add_argument("--hog", type=int, default=1, help="busy-loop processes running throughout")
    parser.add_argument("--ending", choices=ENDINGS, default="destroy", help="how each rank ends (see above)")
    parser.add_argument("--start", choices=("fork", "exec"), default="fork", help="how a rank is started")
    parser.add_argument("--checkpoint-group", action="store_true",
                        help="also use and destroy a second group from a thread, as the checkpointer does")
    parser.add_argument("--fsdp", action="store_true",
                        help="also shard a 2-layer model with FSDP2 over the group and keep it to the end")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="a pair still running after this hangs")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # set for a rank started by --start exec
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.ending, args.checkpoint_group, args.fsdp)
        return
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    try:
        main()
    except _ChildExit as child:  # a forked rank: leave through the interpreter's normal exit
        sys.exit(child.code)
