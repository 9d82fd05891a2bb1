"""Self-healing runs: a died or hung job restarts from its checkpoint, a lost generation device is
revived in place, and a hang leaves every process's stacks behind.

Fast tests drive the pieces directly (the slice client on in-process fakes that "die", the
watchdog on a real stuck process, a fault that fires once per job); the integration tests run real
jobs: two local controller processes killed in training, a Ray job that hangs in training, and a
Ray judge device killed while it scores. Only recorded facts are asserted (records, restart lines,
stack files), never a measured duration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.controller.handles import LocalHandle, LocalStream, Ready, WorkerLost
from gcore_rl.controller.slice import SliceClient
from gcore_rl.errors import ProcessFailure
from gcore_rl.faults import ENV as FAULT_ENV
from gcore_rl.faults import ONCE_ENV, marker_path
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.placement.plan import Plan, WorkerSpec
from gcore_rl.records import Completion, RewardInput, Verdict
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.runtime.driver import run_job
from gcore_rl.runtime.healing import (
    DEVICE_RESTARTS_FILE,
    RESTARTS_FILE,
    STACKS_DIR,
    Watchdog,
    record_device_restart,
    record_restart,
    record_training_again,
    restart_config,
)
from gcore_rl.telemetry.heartbeat import BEAT_INTERVAL_S, Heartbeat

ray = pytest.importorskip("ray")

UNTIMED = ("time", "throughput/", "util/", "memory/")
"""Metrics that measure the machine rather than the run (left out of the comparison)."""
TINY = TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64)


# ---- the slice client revives a lost generation device (in-process fakes) -------------------------


class _Lost(Ready):
    """A pending result whose worker died before answering."""

    def __init__(self):  # noqa: D107 - no value
        pass

    @property
    def value(self):
        raise WorkerLost("the device's process died")


class FlakyHandle(LocalHandle):
    """An in-process handle whose worker "dies" once, at its first call of `dies_in`, and can be revived."""

    restartable = True

    def __init__(self, worker, dies_in: str):
        super().__init__(worker)
        self.dies_in = dies_in
        self.incarnation = 0

    def revive(self):
        self.incarnation += 1
        self.worker.log.append((self.worker.name, "revived"))

    def call(self, method, *args, **kwargs):
        if method.__name__ == self.dies_in and self.incarnation == 0:
            return _Lost()
        return super().call(method, *args, **kwargs)

    def stream(self, method, *args, **kwargs):
        inner = super().stream(method, *args, **kwargs)
        if method.__name__ != self.dies_in or self.incarnation > 0:
            return inner

        def dies_after_one_chunk():
            yield next(inner._iterator)
            raise WorkerLost("the device's process died")
        return LocalStream(dies_after_one_chunk())


class FakeWorker:
    """Generates one chunk per sample (token = the prompt's first id), judges, publishes, loads; logs every call."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def generate_stream(self, prompt_ids, sampling, seed):
        for sample in range(sampling.n):
            for index, prompt in enumerate(prompt_ids):
                self.log.append((self.name, "chunk"))
                yield [Completion(prompt_index=index, sample_index=sample, prompt_ids=prompt, token_ids=[prompt[0]],
                                  logprobs=[0.0], finish_reason="stop")]

    def score_samples(self, samples):
        self.log.append((self.name, "judge", len(samples)))
        return {"judge": [Verdict(score=1.0, reward=float(s.completion), parsed=True, text="") for s in samples]}

    def publish_weights(self, bucket_bytes, version=0, load=False):
        if self.name == "t":
            yield {"w": torch.ones(1)}

    def load_weights(self, weights, version, final):
        self.log.append((self.name, "load", sorted(weights), version, final))

    def begin_step(self, step):
        self.log.append((self.name, "begin_step", step))


def _disaggregated_slice(dies: str, in_method: str):
    """A one-slice disaggregated client: trainer t (publishes), rollout device r, judge device j; the
    device named `dies` dies once in `in_method`."""
    log: list = []
    restarts: list = []
    workers = {name: FakeWorker(name, log) for name in "trj"}
    handles = [FlakyHandle(w, in_method) if name == dies else LocalHandle(w) for name, w in workers.items()]
    specs = [WorkerSpec(0, 0, ("actor",), 0, 1, False, True), WorkerSpec(1, 0, ("rollout",), None, 1, False, False),
             WorkerSpec(2, 0, ("judge",), None, 1, False, False)]
    layout = Plan("disaggregated", (0, 1, 2), ((0, 1, 2),), {"rollout": {"rollout": (1,), "judge": (2,)},
                                                             "update": {"actor": (0,)}}, roles=("actor", "rollout", "judge"))
    client = SliceClient(handles, specs, layout, on_restart=lambda *record: restarts.append(record))
    return client, log, restarts


def _roll_out(client: SliceClient):
    return client.rollout_and_score([[3], [7]], SamplingConfig(n=2), seed=0,
                                    on_finished=lambda chunk: [RewardInput("p", str(c.token_ids[0]), {}) for c in chunk])


def test_a_lost_judge_device_is_revived_and_its_batch_scored_again():
    client, log, restarts = _disaggregated_slice("j", "score_samples")
    client.begin_step(4)
    result = _roll_out(client)
    assert {k: v.reward for k, v in result.scores["judge"].items()} == {(0, 0): 3.0, (0, 1): 3.0, (1, 0): 7.0, (1, 1): 7.0}
    assert [(d, step) for d, step, _, _ in restarts] == [(2, 4)] and "died" in restarts[0][2]
    assert restarts[0][3] >= 0  # seconds from the loss seen to the device back
    # revived once, told the step, and then sent the batch it had lost (the judge holds no policy: no weights)
    revived = log.index(("j", "revived"))
    assert log[revived + 1] == ("j", "begin_step", 4) and log[revived + 2][:2] == ("j", "judge")
    assert not [entry for entry in log if entry[1] == "load"]


def test_a_lost_rollout_stream_is_generated_again_with_the_last_published_weights():
    client, log, restarts = _disaggregated_slice("r", "generate_stream")
    client.begin_step(2)
    client.sync_weights(1)  # the published bucket is kept: the rollout device can be revived
    result = _roll_out(client)
    # every sample exactly once (the first chunk arrived before the death and is not taken again), all judged
    assert [(c.prompt_index, c.sample_index) for c in result.completions] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(result.scores["judge"]) == 4 and [(d, s) for d, s, _, _ in restarts] == [(1, 2)]
    revived = log.index(("r", "revived"))
    assert log[revived + 1: revived + 4] == [("r", "begin_step", 2), ("r", "load", ["w"], 1, False), ("r", "load", [], 1, True)]


def test_a_lost_device_that_cannot_be_revived_fails_the_rollout():
    client, _, restarts = _disaggregated_slice("j", "score_samples")
    client.scorers[0].restartable = False
    with pytest.raises(WorkerLost):
        _roll_out(client)
    assert restarts == []


# ---- faults, the watchdog and the restart decision --------------------------------------------------


def _python(code: str, env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env}, cwd=cwd)


def test_a_fault_fires_once_per_job_when_a_marker_is_set(tmp_path):
    code = "from gcore_rl.faults import maybe_fail\nmaybe_fail('train', 3)\n"
    env = {FAULT_ENV: "train:3", ONCE_ENV: str(marker_path(tmp_path))}
    assert _python(code, env, tmp_path).wait(60) == -9  # SIGKILL
    assert _python(code, env, tmp_path).wait(60) == 0  # the marker says it has fired
    assert "train:3" in marker_path(tmp_path).read_text()


def test_the_watchdog_dumps_the_stacks_of_a_hung_process_and_names_its_last_phase(tmp_path):
    watchdog = Watchdog(tmp_path, timeout_s=3600.0)  # before the process starts, as in a runtime: it signals only younger ones
    stuck = _python(f"""
        import time
        from gcore_rl.runtime.healing import enable_stack_dumps
        enable_stack_dumps({str(tmp_path)!r}, "device-0")
        def stuck_in_train():
            while True:
                time.sleep(0.1)
        stuck_in_train()
        """, {}, tmp_path)
    try:
        beat = Heartbeat(tmp_path, "device-0")
        beat.begin_step(2)
        beat.record("update/prepare", 0.0, 0.0)
        watchdog.check()  # the last phase ended well within the timeout: no hang
        while not (tmp_path / STACKS_DIR / "device-0.pid").exists():  # registered for stack dumps
            assert stuck.poll() is None
            time.sleep(0.1)
        watchdog.timeout_s = 0.0
        time.sleep(BEAT_INTERVAL_S + 0.1)  # a stall longer than the timeout plus the heartbeat's allowance
        with pytest.raises(ProcessFailure, match=r"hang: no progress .* in step 2 after phase update/prepare ended on device-0"):
            watchdog.check()
        assert "stuck_in_train" in (tmp_path / STACKS_DIR / "device-0.txt").read_text()
        assert stuck.poll() is None  # the watchdog dumps the stacks; killing the job is the runtime's part
    finally:
        stuck.kill()
        stuck.wait()


def test_a_restart_records_when_the_job_trained_again_and_how_long_after_the_kill(tmp_path):
    """restarts.jsonl: the failure seen (`time`), the injected kill (`kill_at`, from the fault's marker), and,
    once the restarted job trained, the first `update/train` span after the restart on any device."""
    marker_path(tmp_path).write_text("train:4 pid 12 at 1000.250\n")
    record_restart(tmp_path, 1, 2, ProcessFailure("controller 0 died"))
    restart = json.loads((tmp_path / RESTARTS_FILE).read_text())
    assert restart["kill_at"] == 1000.25 and restart["time"] > 1000.25
    assert record_training_again(tmp_path) is None  # no timeline yet: nothing trained since
    seen = restart["time"]
    timeline = tmp_path / "timeline"
    timeline.mkdir()
    spans = {0: [("update/train", seen - 50), ("rollout/generate", seen + 1), ("update/train", seen + 9)],
             1: [("update/prepare", seen + 2), ("update/train", seen + 7)]}
    for device, events in spans.items():
        (timeline / f"device-{device}.jsonl").write_text("".join(
            json.dumps({"step": 4, "device": device, "role": "r", "what": what, "start": start, "end": start + 1}) + "\n"
            for what, start in events))
    assert record_training_again(tmp_path) == pytest.approx(7.0)
    restart = json.loads((tmp_path / RESTARTS_FILE).read_text())
    assert restart["training_again_at"] == seen + 7  # the earliest training after the restart, not the one before
    assert restart["kill_to_training_s"] == pytest.approx(seen + 7 - 1000.25, abs=1e-3)
    assert record_training_again(tmp_path) is None  # a completed record is left as it is
    record_device_restart(tmp_path, 0, 1, 2, "device 1 died", revive_s=3.25)
    revived = json.loads((tmp_path / DEVICE_RESTARTS_FILE).read_text())
    assert revived["revive_s"] == 3.25 and revived["kill_to_back_s"] == pytest.approx(revived["time"] - 1000.25)


def test_a_restart_resumes_from_this_runs_checkpoint_or_where_the_job_began(tmp_path):
    fresh = load_config(JobConfig, None, [f"run.output_dir={tmp_path / 'run'}"])
    assert restart_config(fresh).run.resume == "auto"
    forked = load_config(JobConfig, None, [f"run.output_dir={tmp_path / 'run'}", f"run.resume={tmp_path / 'step-00000004'}"])
    assert restart_config(forked).run.resume == str(tmp_path / "step-00000004")  # no checkpoint of its own yet


# ---- whole jobs -------------------------------------------------------------------------------------


def _records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(UNTIMED)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_local_controllers_killed_in_training_restart_from_the_checkpoint(tmp_path, monkeypatch, capsys):
    """Controller processes SIGKILLed in step 4's training (one of them: the fault fires once per job); the
    save of step 2 was completed at the end of step 3, so the restarted job resumes from it and must
    record what the uninterrupted job recorded."""
    model = write_tiny_model(tmp_path / "tiny", TINY)

    def job(name: str) -> JobConfig:
        return load_config(JobConfig, None, [
            f"model.path={model}", f"run.output_dir={tmp_path / name}", "run.steps=5", "run.checkpoint_every=2",
            "run.max_restarts=1", "run.prompts_per_step=4", "sampling.n=2", "sampling.max_new_tokens=6",
            "data.eval_prompts=0", "run.progress=false", "run.save_final=false", "runtime.controllers=2",
            "runtime.threads_per_process=1", "reward.rules.0.fn=gcore_rl.rewards.builtin:digit_accuracy"])

    run_job(job("uninterrupted"))
    expected = _records(tmp_path / "uninterrupted")
    assert len({m["pg_loss"] for m in expected}) > 1, "the job must train, or equality would prove nothing"
    monkeypatch.setenv(FAULT_ENV, "train:4")
    capsys.readouterr()
    summary = run_job(job("killed"))
    out = tmp_path / "killed"
    assert summary.steps == 5 and _records(out) == expected
    restarts = [json.loads(line) for line in (out / RESTARTS_FILE).read_text().splitlines()]
    assert [r["restart"] for r in restarts] == [1] and "died" in restarts[0]["cause"]
    printed = capsys.readouterr().out
    assert "restart 1 of 1" in printed and "continuing from" in printed and "step-00000002" in printed



@pytest.fixture(scope="module")
def ray_instance():
    ray.init(num_cpus=2, resources={"device": 2}, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return (write_tiny_model(root / "base", TINY),
            write_tiny_model(root / "judge", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64, seed=5)))


def _ray_job(out: Path, base: Path, strategy: str, *extra: str) -> JobConfig:
    return load_config(JobConfig, None, [
        f"model.path={base}", f"run.output_dir={out}", "run.steps=3", "run.prompts_per_step=4", "sampling.n=2",
        "sampling.max_new_tokens=6", "data.eval_prompts=0", "run.progress=false", "run.save_final=false",
        "runtime.kind=ray", "runtime.controllers=1", "runtime.devices_per_controller=2", "runtime.threads_per_process=1",
        f"placement.strategy={strategy}", "run.max_restarts=1", *extra])


@pytest.mark.slow  # waits out the 20 s timeout; the watchdog itself is tested fast above
def test_a_hung_ray_job_dumps_every_stack_and_restarts(ray_instance, models, tmp_path, monkeypatch):
    out = tmp_path / "hung"
    monkeypatch.setenv(FAULT_ENV, "hang-train:2")
    summary = run_job(_ray_job(out, models[0], "colocate", "runtime.phase_timeout_s=20"))
    assert summary.steps == 3 and len(_records(out)) == 3
    restarts = [json.loads(line) for line in (out / RESTARTS_FILE).read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["cause"].startswith("hang: no progress")
    assert "in step 2" in restarts[0]["cause"]
    stacks = {path.stem: path.read_text() for path in (out / STACKS_DIR).glob("*.txt")}
    assert set(stacks) == {"controller-0", "device-0", "device-1"}
    hung = [name for name, text in stacks.items() if "maybe_fail" in text]
    assert len(hung) == 1 and hung[0].startswith("device-") and "faults.py" in stacks[hung[0]]
    assert "File" in stacks["controller-0"]  # every process dumped its threads, not only the hung one


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["score:2", "generate:2"])
def test_a_generation_device_killed_in_the_rollout_is_revived_and_the_step_completes(ray_instance, models, tmp_path,
                                                                                     monkeypatch, fault):
    """Disaggregated, one slice of 2 devices: device 0 trains, device 1 generates and judges (no trainer
    shard), so its death while it judges (or generates) is healed in place: the step goes on with every
    sample generated once and scored."""
    out = tmp_path / "killed"
    monkeypatch.setenv(FAULT_ENV, fault)
    base, judge = models
    run_job(_ray_job(out, base, "disaggregated", "judge.enabled=true", f"judge.model_path={judge}", "judge.weight=1.0",
                     "reward.rules.0.weight=0.0"))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["reward/count"] == 8 and line["reward/mean"] == pytest.approx(line["judge/mean_score"])
               for line in lines)  # every sample of every step was judged
    restarted = [json.loads(line) for line in (out / DEVICE_RESTARTS_FILE).read_text().splitlines()]
    assert [(r["controller"], r["device"]) for r in restarted] == [(0, 1)]
    assert not (out / RESTARTS_FILE).exists()  # healed in place, not by restarting the job
