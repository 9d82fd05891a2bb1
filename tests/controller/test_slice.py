"""SliceClient on in-process fake workers: prompt split, streaming to the reward models, row balancing, sync."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.controller.handles import LocalHandle
from gcore_rl.controller.slice import SliceClient, reduce_stats, split_evenly
from gcore_rl.placement.plan import Plan, WorkerSpec, plan
from gcore_rl.placement.rebalance import DeviceLoad
from gcore_rl.records import Completion, RewardInput, TokenBatch, Verdict
from gcore_rl.rollout.sampling import SamplingConfig


class FakeWorker:
    """Records every call in a shared log; generates one chunk per sample."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def generate_stream(self, prompt_ids, sampling, seed):
        for sample in range(sampling.n):
            for index, prompt in enumerate(prompt_ids):
                self.log.append((self.name, "chunk", prompt[0], sample))
                yield [Completion(prompt_index=index, sample_index=sample, prompt_ids=prompt, token_ids=[prompt[0]],
                                  logprobs=[0.0], finish_reason="stop")]

    def score_samples(self, samples):
        self.log.append((self.name, "judge", len(samples)))
        verdicts = [Verdict(score=float(s.completion), reward=float(s.completion) / 10, parsed=True, text="") for s in samples]
        return {"judge": verdicts, "reward_model": [Verdict.of_score(-float(s.completion)) for s in samples]}

    def train(self, batch: TokenBatch):
        self.log.append((self.name, "train", batch.input_ids[:, 0].tolist()))
        return {"pg_loss": 1.0, "gap_max": float(batch.size)}

    def sync_weights(self, version, load=True):
        self.log.append((self.name, "sync", load))

    def device_load(self):
        return {"r": DeviceLoad(generate_s=1.5, generate_fixed_s=0.5, swap_s=0.2), "j": DeviceLoad(generate_s=1.0),
                "x": DeviceLoad(score_s=2.0 + 0.5, score_fixed_s=0.25)}.get(self.name, DeviceLoad())

    def publish_weights(self, bucket_bytes, version=0, load=False):
        self.log.append((self.name, "publish"))
        if self.name == "t0":
            yield {"w": torch.ones(1)}
            yield {"v": torch.full((1,), 2.0)}

    def load_weights(self, weights, version, final):
        self.log.append((self.name, "load", {k: float(v) for k, v in weights.items()}, final))


def _spec(device, roles, publishes=False):
    return WorkerSpec(device, 0, roles, 0 if "actor" in roles else None, 1, True, publishes)


def _plan(strategy: str, rollout: tuple[int, ...], judge: tuple[int, ...] = ()) -> Plan:
    """A one-slice plan whose rollout phase puts the policy on `rollout` and the judge on `judge`."""
    devices = tuple(sorted({*rollout, *judge}))
    phases = {"rollout": {"rollout": rollout, **({"judge": judge} if judge else {})}, "update": {}}
    return Plan(strategy, devices, (devices,), phases, roles=("rollout", "judge"))


def _judged(stream_to_scorers: bool):
    log: list = []
    workers = [FakeWorker("r", log), FakeWorker("j", log)]
    layout = _plan("partial" if stream_to_scorers else "colocate", rollout=(0,), judge=(1,))
    client = SliceClient([LocalHandle(w) for w in workers], [_spec(0, ("rollout", "actor")), _spec(1, ("judge", "actor"))],
                         layout)
    result = client.rollout_and_score([[3], [7]], SamplingConfig(n=2), seed=0,
                                      on_finished=lambda chunk: [RewardInput("p", str(c.token_ids[0]), {}) for c in chunk])
    return result, log


def test_streaming_sends_each_finished_completion_to_the_judge_before_the_next_is_generated():
    result, log = _judged(stream_to_scorers=True)
    assert [entry[1] for entry in log] == ["chunk", "judge"] * 4
    assert [(c.prompt_index, c.sample_index) for c in result.completions] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {k: v.reward for k, v in result.scores["judge"].items()} == {(0, 0): 0.3, (0, 1): 0.3, (1, 0): 0.7, (1, 1): 0.7}
    assert {k: v.reward for k, v in result.scores["reward_model"].items()} == {(0, 0): -3.0, (0, 1): -3.0, (1, 0): -7.0,
                                                                              (1, 1): -7.0}


def test_without_streaming_the_judge_gets_the_whole_wave_at_once():
    result, log = _judged(stream_to_scorers=False)
    assert [entry[1] for entry in log] == ["chunk"] * 4 + ["judge"] and log[-1] == ("j", "judge", 4)
    assert len(result.scores["judge"]) == 4


def test_prompts_split_over_rollout_devices_keep_their_indices():
    log: list = []
    workers = [FakeWorker("a", log), FakeWorker("b", log)]
    client = SliceClient([LocalHandle(w) for w in workers], [_spec(0, ("rollout",)), _spec(1, ("rollout",))],
                         _plan("colocate", rollout=(0, 1)))
    completions = client.generate([[1], [2], [3]], SamplingConfig(n=1), seed=0)
    assert [(c.prompt_index, c.token_ids) for c in completions] == [(0, [1]), (1, [2]), (2, [3])]
    assert {entry[0] for entry in log if entry[2] in (1, 2)} == {"a"} and {e[0] for e in log if e[2] == 3} == {"b"}


def test_training_rows_are_balanced_and_weights_published_once_per_slice():
    log: list = []
    trainers = [FakeWorker("t0", log), FakeWorker("t1", log)]
    rollout = FakeWorker("r", log)
    client = SliceClient([LocalHandle(w) for w in [*trainers, rollout]],
                         [_spec(0, ("actor",), publishes=True), _spec(1, ("actor",)), _spec(2, ("rollout",))],
                         _plan("disaggregated", rollout=(2,)))
    lengths = [5, 1, 4, 2]
    ids = torch.tensor([[row] + [0] * 5 for row in range(4)])
    attention = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    batch = TokenBatch(input_ids=ids, attention_mask=attention, response_mask=attention.float(),
                       rollout_logprobs=torch.zeros(4, 6))
    stats = client.finish_train(client.start_train(batch))
    assert [entry[2] for entry in log if entry[1] == "train"] == [[0, 1], [2, 3]]  # 5+1 vs 4+2 tokens
    assert stats == {"pg_loss": 1.0, "gap_max": 2.0, "train/cost_imbalance": 1.0, "train/token_imbalance": 1.0}
    client.sync_weights(1)
    # buckets stream from the publisher to the rollout device; the update ends with a final call
    assert log[-5:] == [("t0", "publish"), ("r", "load", {"w": 1.0}, False), ("r", "load", {"v": 2.0}, False),
                        ("r", "load", {}, True), ("t1", "publish")]


def test_training_rows_are_split_by_the_row_cost_and_its_imbalance_reported():
    log: list = []
    trainers = [FakeWorker("t0", log), FakeWorker("t1", log)]
    client = SliceClient([LocalHandle(w) for w in trainers], [_spec(0, ("actor", "rollout"), publishes=True),
                                                              _spec(1, ("actor", "rollout"))],
                         _plan("colocate", rollout=(0, 1)), row_cost=lambda length: float(length) ** 2)
    lengths = [6, 3, 3, 2]
    attention = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    ids = torch.tensor([[row] + [0] * 5 for row in range(4)])  # the fake trainer logs each row's first token
    batch = TokenBatch(input_ids=ids, attention_mask=attention, response_mask=attention.float(),
                       rollout_logprobs=torch.zeros(4, 6))
    stats = client.finish_train(client.start_train(batch))
    # costs 36, 9, 9, 4: 36 -> t0, 9 -> t1, 9 -> t1, 4 -> t0 (full at two rows each): 40 vs 18, mean 29
    assert [entry[2] for entry in log if entry[1] == "train"] == [[0, 3], [1, 2]]
    assert stats["train/cost_imbalance"] == pytest.approx(40 / 29)
    assert stats["train/token_imbalance"] == pytest.approx(8 / 7)  # 6 + 2 tokens vs 3 + 3


def test_split_evenly_and_reduce_stats():
    assert split_evenly([1, 2, 3, 4, 5], 2) == [(0, [1, 2, 3]), (3, [4, 5])]
    assert split_evenly([1], 2) == [(0, [1]), (1, [])]
    assert reduce_stats([{"a": 1.0, "x_max": 1.0}, {"a": 3.0, "x_max": 5.0, "b": 2.0}]) == {"a": 2.0, "x_max": 5.0, "b": 2.0}


def test_dynamic_split_moves_roles_and_loads_weights_only_where_the_policy_generates_next():
    log: list = []
    workers = [FakeWorker(name, log) for name in ("r", "j", "x")]
    roles = ("rollout", "judge", "actor")
    first = plan("dynamic", 3, ["actor", "rollout", "judge"], rollout_devices=2)
    client = SliceClient([LocalHandle(w) for w in workers], [_spec(d, roles) for d in range(3)], first)
    assert [h.worker.name for h in client.rollout] == ["r", "j"] and [h.worker.name for h in client.scorers] == ["x"]
    load = client.rollout_load(phase_s=3.0)  # divisible device-seconds summed per side
    assert (load.generate_s, load.generate_fixed_s) == (1.0 + 1.0, 0.5)  # r: 1.5 - its own 0.5 fixed; j: 1.0
    assert (load.score_s, load.score_fixed_s, load.swap_s) == (2.25, 0.25, 0.2)  # swap: the largest handover
    assert (load.phase_s, load.rollout_devices) == (3.0, 2)
    client.apply_plan(first.with_rollout_devices(1))
    assert client.plan.version == 1 and client.plan.devices_of("rollout", "judge") == (1, 2)
    client.sync_weights(1)
    assert [e for e in log if e[1] == "sync"] == [("r", "sync", True), ("j", "sync", False), ("x", "sync", False)]
    result = client.rollout_and_score([[3], [7]], SamplingConfig(n=1), seed=0,
                                      on_finished=lambda chunk: [RewardInput("p", str(c.token_ids[0]), {}) for c in chunk])
    assert {e[0] for e in log if e[1] == "chunk"} == {"r"} and {e[0] for e in log if e[1] == "judge"} == {"j", "x"}
    assert sorted(result.scores["judge"]) == [(0, 0), (1, 0)]
