"""Agent code written against the `openai` client, trained through the endpoint: each sample's requests recorded
as one trajectory (the policy's ids as sampled, the client's new messages inserted and masked), a diverging
history beginning a new segment, errors as OpenAI error responses, and a step through the driver."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from gcore_rl.agents import agent_loop as agent_loop_module
from gcore_rl.agents.agent_loop import agent_loop
from gcore_rl.agents.template import TurnRenderer
from gcore_rl.models.tiny import build_char_tokenizer
from gcore_rl.records import Completion, EpisodePrompt
from gcore_rl.rollout.functions import RolloutRequest, checked_rollout
from gcore_rl.rollout.sampling import SamplingConfig

pytest.importorskip("openai")
TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id


@pytest.fixture(autouse=True)
def _close_endpoints():
    yield
    agent_loop_module.close()


class CountingEngine:
    """Replies "a" once more than the times "again?" was asked before, then EOS; log-prob -0.25 a token. The
    reply depends only on the request, whatever requests share a call."""

    def __init__(self):
        self.batches: list[int] = []

    def continue_stream(self, requests, params, seed=None) -> Iterator[list[Completion]]:
        self.batches.append(len(requests))
        out = []
        for index, r in enumerate(requests):
            count = TOKENIZER.decode(list(r.prompt)).count("again?")
            ids = (TOKENIZER.encode("a" * (count + 1), add_special_tokens=False) + [EOS])[:r.max_new_tokens]
            out.append(Completion(index, list(r.prompt), ids, [-0.25] * len(ids), "stop" if ids[-1] == EOS else "length"))
        yield out


def _run(agent: str, prompts=2, n=2, max_new_tokens=60, context=None, episodes=None) -> tuple[list[Completion], CountingEngine]:
    engine = CountingEngine()
    rows = [EpisodePrompt([1, 2], episodes[i]) if episodes else [1, 2] for i in range(prompts)]
    request = RolloutRequest(engine, rows, SamplingConfig(n=n, max_new_tokens=max_new_tokens), seed=0,
                             tokenizer=TOKENIZER, options={"agent": agent}, context=context)
    done = [c for chunk in checked_rollout(agent_loop(request), prompts, n, "agent_loop") for c in chunk]
    return sorted(done, key=lambda c: (c.prompt_index, c.sample_index)), engine


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_an_openai_client_agents_requests_make_one_trajectory_with_its_reward():
    completions, engine = _run("openai_agents:ask_twice", episodes=[{"question": "2+3="}, {"question": "7?"}])
    again = TurnRenderer(TOKENIZER, role="user").message_ids([{"role": "user", "content": "again?"}])
    for c in completions:
        question = "2+3=" if c.prompt_index == 0 else "7?"
        assert list(c.prompt_ids) == _ids(f"U:{question}\nA:")  # the agent's own first request is the prompt
        assert c.token_ids == _ids("a") + [EOS] + again + _ids("aa") + [EOS]
        assert c.loss_mask == [1, 1] + [0] * len(again) + [1, 1, 1]
        assert c.logprobs == [-0.25, -0.25] + [0.0] * len(again) + [-0.25] * 3
        assert c.turn_rewards == [(len(c.token_ids) - 1, 1.0)]  # "aa" is longer than "a"
        stats = c.rollout_stats
        assert (stats["turns"], stats["requests"], stats["segments"], stats["agent_errors"]) == (2.0, 2.0, 1.0, 0.0)
    assert sum(engine.batches) == 8  # every request generated once, in as many batches as the agents' timing made


def test_a_history_that_diverges_begins_a_new_segment_which_is_the_sample():
    completions, _ = _run("openai_agents:rewrites_history", prompts=1, n=1)
    [c] = completions
    assert c.rollout_stats["segments"] == 2.0 and c.rollout_stats["requests"] == 2.0
    assert list(c.prompt_ids) == _ids("U:a\nA:a!<eos>U:b\nA:") and c.turn_rewards is None


def test_failing_agents_are_counted_and_give_what_they_recorded():
    for agent in ("openai_agents:wrong_model", "openai_agents:raises"):
        completions, _ = _run(agent, prompts=1, n=2)
        assert all(c.rollout_stats["agent_errors"] == 1.0 and c.token_ids == [] for c in completions)
    # over the budget on its second request: the first turn is kept, the error counted
    completions, _ = _run("openai_agents:ask_twice", prompts=1, n=1, max_new_tokens=8)
    [c] = completions
    assert c.rollout_stats["agent_errors"] == 1.0 and c.token_ids == _ids("a") + [EOS]


def test_the_endpoint_answers_what_it_cannot_serve_with_openai_errors():
    from gcore_rl.agents.chat_endpoint import ChatEndpoint

    endpoint = ChatEndpoint(TOKENIZER, "policy", budget=16, context=12)
    try:
        url, _ = endpoint.open_session(0, 0)

        def post(body, path="/chat/completions"):
            req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as answer:
                    return answer.status, json.loads(answer.read())
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read())

        long = {"model": "policy", "messages": [{"role": "user", "content": "x" * 20}]}
        status, body = post(long)
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["code"] == "context_length_exceeded" and "context is 12" in body["error"]["message"]
        status, body = post({"model": "gpt-5", "messages": [{"role": "user", "content": "a"}]})
        assert status == 404 and body["error"]["code"] == "model_not_found" and "serves 'policy'" in body["error"]["message"]
        assert post({"model": "policy", "messages": []})[0] == 400
        assert post({"model": "policy", "messages": [{"role": "user", "content": "a"}], "stream": True})[0] == 400
        assert post({"model": "policy"}, path="/completions")[0] == 404
        with urllib.request.urlopen(url + "/models", timeout=10) as answer:
            assert json.loads(answer.read())["data"][0]["id"] == "policy"
        endpoint.close_session(url)
        assert post({"model": "policy", "messages": [{"role": "user", "content": "a"}]})[1]["error"]["code"] == "session_not_found"
    finally:
        endpoint.close()


def test_an_openai_client_agent_trains_a_step_through_the_driver(tmp_path):
    """The endpoint on the device worker with our engine: every sample asked twice, its reward the agent's plus the
    rule's on the final turn, the counts in the step's record."""
    from pathlib import Path

    from gcore_rl.config import load_job_config
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.runtime.driver import run_job

    model = write_tiny_model(tmp_path / "tiny", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "grpo_addition.yaml"
    cfg = load_job_config(recipe, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=1", "run.prompts_per_step=2",
        "run.eval_every=0", "run.stop_at_eval_accuracy=0", "data.eval_prompts=0", "run.progress=false",
        "runtime.threads_per_process=1", "sampling.max_new_tokens=24", "rollout.function=gcore_rl.agents.agent_loop:agent_loop",
        "rollout.options={agent: openai_agents:ask_twice}"])
    run_job(cfg)
    [record] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout/requests"] == 2.0 and record["rollout/agent_errors"] == 0.0
    assert record["rollout/segments"] == 1.0 and record["rollout/turns"] == 2.0 and record["rollout/inserted_tokens"] > 0
    assert record["rollout/logprob_gap_max"] < 1e-4  # the trajectory's ids and log-probs are the engine's


class DigitsEngine(CountingEngine):
    """As `CountingEngine`, but a reply after "again?" is digits: the verifiers environment's reward is 1."""

    def continue_stream(self, requests, params, seed=None):
        for chunk in super().continue_stream(requests, params, seed):
            for c in chunk:
                if "again?" in TOKENIZER.decode(c.prompt_ids):
                    c.token_ids = _ids("12") + [EOS]
                    c.logprobs = [-0.25] * 3
            yield chunk


def test_a_verifiers_environment_plays_its_episodes_through_the_endpoint():
    """A verifiers (v1) environment on an in-memory taskset (tests/agents/vf_digits.py: it asks, then asks again as
    the user, and rewards the share of digits in the last reply), its agent in this process: each sample one
    episode, recorded as one trajectory, with the environment's reward."""
    pytest.importorskip("verifiers.v1")
    engine = DigitsEngine()
    prompts = [EpisodePrompt([1, 2], {"task": i}) for i in range(2)]
    request = RolloutRequest(engine, prompts, SamplingConfig(n=2, max_new_tokens=60), seed=0, tokenizer=TOKENIZER,
                             options={"agent": "gcore_rl.agents.verifiers_env:run_episode",
                                      "agent_options": {"env": "vf_digits:make_env"}})
    done = sorted((c for chunk in checked_rollout(agent_loop(request), 2, 2, "agent_loop") for c in chunk),
                  key=lambda c: (c.prompt_index, c.sample_index))
    again = TurnRenderer(TOKENIZER, role="user").message_ids([{"role": "user", "content": "again?"}])
    for c in done:
        assert list(c.prompt_ids) == _ids(f"U:{['2+3=', '7*6='][c.prompt_index]}\nA:")  # the task's question
        assert c.token_ids == _ids("a") + [EOS] + again + _ids("12") + [EOS]
        assert c.rollout_stats["segments"] == 1.0 and c.rollout_stats["agent_errors"] == 0.0
        assert c.turn_rewards == [(len(c.token_ids) - 1, 1.0)]  # the environment's digit share of "12"
