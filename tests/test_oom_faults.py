"""Out of memory, as a user meets it: one paragraph naming the role, the phase, the device, the step and the
settings that need less memory; a non-zero exit with every checkpoint intact; no restart into the same failure.

A failed allocation is recognised as torch and Python raise it (a real `RLIMIT_AS`-limited process), the CLI is
run with an injected one (`GCORE_FAULT=oom-train:N`), and a process ended by SIGKILL (the kernel's OOM killer)
is named by its parent.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from cli_helpers import NO_STOP, RECIPE, REPO, SHORT, assert_user_error, gcore_rl, init_tiny

import gcore_rl.runtime.driver as driver
from gcore_rl.checkpoint.manifest import verify
from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.errors import OutOfMemory, ProcessFailure
from gcore_rl.oom import is_out_of_memory, killed_by, naming


def test_every_kind_of_failed_allocation_is_recognised_and_nothing_else():
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                                         "memory: you tried to allocate 34359738368 bytes. Error code 12"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only allocation errors' types


def test_the_paragraph_names_role_phase_device_step_and_what_to_lower():
    with pytest.raises(OutOfMemory) as raised, naming("actor", "update", "cpu (device 1)", 7):
        raise MemoryError
    text = str(raised.value)
    assert "out of memory in the actor's update on cpu (device 1) in step 7" in text
    assert "train.micro_batch_size" in text and "train.activation_checkpointing=true" in text
    assert "run.resume=auto" in text
    with pytest.raises(OutOfMemory, match="engine.max_num_seqs"), naming("rollout", "generation", "cpu", 1):
        raise MemoryError
    with pytest.raises(ValueError), naming("actor", "update", "cpu", 1):
        raise ValueError("not memory")


def test_a_real_address_space_limit_is_named():
    """A process whose address space is capped (`RLIMIT_AS`, as a container's limit caps it) asks torch for more."""
    script = textwrap.dedent("""
        import resource, torch
        from gcore_rl.oom import naming
        from gcore_rl.errors import OutOfMemory
        size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), size + (256 << 20)))
        try:
            with naming("actor", "update", "cpu (device 0)", 3):
                torch.ones(1 << 30)  # 4 GiB
        except OutOfMemory as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "out of memory in the actor's update on cpu (device 0) in step 3" in done.stdout, done.stderr


def test_a_process_killed_by_sigkill_is_named_as_the_oom_killer_would_leave_it():
    assert "out-of-memory killer" in killed_by(signal.SIGKILL)
    assert killed_by(signal.SIGTERM) == "" and killed_by(None) == ""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return init_tiny(tmp_path_factory.mktemp("oom"))


def test_an_update_that_runs_out_of_memory_stops_the_run_in_one_paragraph_with_its_checkpoint_intact(tiny, tmp_path):
    out = tmp_path / "run"
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", f"run.output_dir={out}", "run.steps=3",
                    "run.checkpoint_every=1", "data.eval_prompts=0", NO_STOP, "run.save_final=false",
                    "run.max_restarts=2", *SHORT, cwd=tmp_path, fault="oom-train:2")
    assert_user_error(proc, 1, "out of memory in the actor's update on cpu (device 0) in step 2",
                      "train.micro_batch_size", "run.resume=auto")
    verify(out / "checkpoints" / "step-00000001")
    assert not (out / "restarts.jsonl").exists()  # an out-of-memory error is not restarted into again


def test_out_of_memory_in_the_driver_itself_is_one_paragraph(tiny, tmp_path):
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", f"run.output_dir={tmp_path / 'run'}", "run.steps=1",
                    "data.eval_prompts=0", NO_STOP, *SHORT, cwd=tmp_path, fault="oom-driver:0")
    assert_user_error(proc, 1, "out of memory in the driver, the `gcore-rl train` process itself",
                      "run.prompts_per_step", "run.resume=auto")


def test_a_job_that_fails_the_same_way_in_the_same_step_is_not_restarted_again(tiny, tmp_path, monkeypatch):
    cfg = load_config(JobConfig, None, [f"model.path={tiny}", f"run.output_dir={tmp_path / 'run'}", "run.max_restarts=5",
                                        "run.progress=false"])
    attempts = []

    def dies(cfg, plan, kind):
        attempts.append(cfg.run.resume)
        raise ProcessFailure(f"a controller process exited unexpectedly (it died: process {len(attempts)} terminated "
                             "with signal SIGKILL)." + killed_by(signal.SIGKILL))

    monkeypatch.setattr(driver, "_run_runtime", dies)
    with pytest.raises(ProcessFailure, match="failed the same way in step 1 before its last restart"):
        driver.run_job(cfg)
    assert len(attempts) == 2  # one restart, then the same failure again: stop
    assert (tmp_path / "run" / "restarts.jsonl").read_text().count("\n") == 1


@pytest.mark.slow
def test_out_of_memory_in_a_ray_actor_is_the_same_paragraph(tiny, tmp_path):
    """The trainer runs in a Ray actor under `disaggregated`; its error crosses to the driver as the same paragraph."""
    out = tmp_path / "run"
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", f"run.output_dir={out}", "run.steps=3",
                    "run.checkpoint_every=1", "data.eval_prompts=0", NO_STOP, "run.save_final=false", *SHORT,
                    "runtime.kind=ray", "runtime.devices_per_controller=2", "placement.strategy=disaggregated",
                    cwd=tmp_path, fault="oom-train:2")
    assert_user_error(proc, 1, "out of memory in the actor's update on cpu (device 0) in step 2", "train.micro_batch_size")
    verify(out / "checkpoints" / "step-00000001")
