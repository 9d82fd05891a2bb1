"""The rollout seam: rollout functions that call the engine several times, loss masks on inserted tokens, the
continuation contract, and a second backend built by import path through the one factory."""

from __future__ import annotations

import copy

import pytest
import torch
from fake_backend import CALLS_FILE, HFGenerateEngine
from test_engine import _prompts  # noqa: I001  (tests/rollout, on the path)

from gcore_rl.errors import ConfigError, RolloutError
from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model, write_tiny_model
from gcore_rl.records import Completion, build_token_batch
from gcore_rl.rollout.backends import EngineConfig, EngineSource, build_engine
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.rollout.functions import (
    RolloutConfig,
    RolloutRequest,
    checked_rollout,
    load_rollout_function,
    single_turn,
)
from gcore_rl.rollout.protocol import Continuation, RolloutEngine
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.training.logprobs import token_logprobs

TOOL = "tool_rollout:tool_between_turns"


def _engines(model, tokenizer, tmp_path) -> dict[str, RolloutEngine]:
    return {"builtin": GenerationEngine(copy.deepcopy(model), tokenizer.eos_token_id, tokenizer.pad_token_id),
            "fake": HFGenerateEngine(copy.deepcopy(model), tokenizer.eos_token_id, tokenizer.pad_token_id,
                                     tmp_path / CALLS_FILE)}


def _rollout(engine, tokenizer, params, function=TOOL, **options) -> list[Completion]:
    fn = load_rollout_function(RolloutConfig(function=function))
    prompts = _prompts(tokenizer)
    request = RolloutRequest(engine, prompts, params, seed=5, tokenizer=tokenizer, options=options)
    done = [c for chunk in checked_rollout(fn(request), len(prompts), params.n, function) for c in chunk]
    return sorted(done, key=lambda c: (c.prompt_index, c.sample_index))


@pytest.mark.parametrize("backend", ["builtin", "fake"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_two_turns_with_tool_tokens_mask_them_and_match_the_trainers_logprobs(tiny, tmp_path, backend, temperature):
    """fp32: the trainer's recomputed log-prob of every policy token equals the engine's within 1e-5, on both
    sides of the tool's tokens (the second turn read them as context); the tool's tokens have mask 0 and
    log-prob 0 in the batch, and everything after each completion is padding."""
    model, tokenizer = tiny
    engine = _engines(model, tokenizer, tmp_path)[backend]
    params = SamplingConfig(n=3, max_new_tokens=8, temperature=temperature, ignore_eos=True)
    completions = _rollout(engine, tokenizer, params, first_turn_tokens=3, second_turn_tokens=4, tool_text="[7]")
    tool = tokenizer.encode("[7]", add_special_tokens=False)
    assert len(completions) == 4 * 3
    for c in completions:
        assert c.token_ids[3:6] == tool and c.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
        assert c.policy_token_count == 7

    batch = build_token_batch(completions, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, params.logprob_temperature)
    policy = batch.response_mask.bool()
    assert int(policy.sum()) == 7 * len(completions)
    torch.testing.assert_close(trainer[policy], batch.rollout_logprobs[policy], rtol=0, atol=1e-5)
    prompt_len = max(len(c.prompt_ids) for c in completions)
    tool_columns = batch.response_mask[:, prompt_len + 3:prompt_len + 6]
    assert not tool_columns.any() and not batch.rollout_logprobs[:, prompt_len + 3:prompt_len + 6].any()
    assert batch.attention_mask[:, prompt_len + 3:prompt_len + 6].all()  # the policy reads the tool's tokens


@pytest.mark.parametrize("backend", ["builtin", "fake"])
def test_a_continuation_with_nothing_appended_is_the_rest_of_one_generation(tiny, tmp_path, backend):
    """The continuation contract: continuing the first 3 greedy tokens for 5 more gives the same 8 tokens and
    log-probs (fp32 round-off) as generating 8 at once; each request's `prompt_index` is its own index."""
    model, tokenizer = tiny
    engine = _engines(model, tokenizer, tmp_path)[backend]
    prompts = _prompts(tokenizer)
    greedy = SamplingConfig(n=1, max_new_tokens=8, temperature=0.0, ignore_eos=True)
    whole = engine.generate(prompts, greedy, seed=0)
    head = engine.generate(prompts, greedy, seed=0, max_new_tokens=[3] * len(prompts))
    requests = [Continuation(prefix=[*p, *h.token_ids], appended=[], max_new_tokens=5)
                for p, h in zip(prompts, head, strict=True)]
    tails = sorted((c for chunk in engine.continue_stream(requests, greedy, seed=0) for c in chunk),
                   key=lambda c: c.prompt_index)
    assert [t.prompt_index for t in tails] == list(range(len(prompts)))
    for w, h, t, r in zip(whole, head, tails, requests, strict=True):
        assert list(t.prompt_ids) == list(r.prompt)
        assert h.token_ids + t.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(h.logprobs + t.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)


def test_single_turn_is_one_engine_call_with_no_mask(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(copy.deepcopy(model), tokenizer.eos_token_id, tokenizer.pad_token_id)
    params = SamplingConfig(n=2, max_new_tokens=5)
    direct = engine.generate(_prompts(tokenizer), params, seed=5)
    engine.take_stats()
    via = _rollout(engine, tokenizer, params, function="gcore_rl.rollout.functions:single_turn")
    assert [c.token_ids for c in via] == [c.token_ids for c in direct]
    assert all(c.loss_mask is None for c in via)
    assert engine.take_stats().calls == 1
    assert single_turn.__module__ == "gcore_rl.rollout.functions"


def _broken(kind: str):
    def fn(request: RolloutRequest):
        good = list(request.engine.generate(request.prompts, request.params, seed=request.seed))
        if kind == "short_mask":
            good[0].loss_mask = [1] * (len(good[0].token_ids) - 1)
        elif kind == "logprob_on_inserted":
            good[0].loss_mask = [0] * len(good[0].token_ids)
        elif kind == "twice":
            good[1] = copy.copy(good[0])
        elif kind == "missing":
            good = good[:-1]
        elif kind == "out_of_range":
            good[0].sample_index = request.params.n
        yield good
    return fn


@pytest.mark.parametrize("kind, words", [
    ("short_mask", "lengths differ"), ("logprob_on_inserted", "non-zero log-prob"), ("twice", "twice"),
    ("missing", "were asked for"), ("out_of_range", "of a request for")])
def test_completions_that_break_the_contract_are_refused_by_name(tiny, kind, words):
    model, tokenizer = tiny
    engine = GenerationEngine(copy.deepcopy(model), tokenizer.eos_token_id, tokenizer.pad_token_id)
    params = SamplingConfig(n=2, max_new_tokens=4, temperature=1.0)
    request = RolloutRequest(engine, _prompts(tokenizer), params, seed=1)
    with pytest.raises(RolloutError, match=words) as caught:
        for _ in checked_rollout(_broken(kind)(request), 4, 2, "my.module:fn"):
            pass
    assert "my.module:fn" in str(caught.value)


def test_the_factory_builds_a_backend_by_name_or_import_path_and_refuses_unknown_ones(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny", TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64))
    tokenizer = build_char_tokenizer()
    source = EngineSource(str(model_dir), torch.device("cpu"), tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert isinstance(build_engine(EngineConfig(), source), GenerationEngine)
    fake = build_engine(EngineConfig(backend="fake_backend:build"), source)
    assert isinstance(fake, HFGenerateEngine) and isinstance(fake, RolloutEngine)
    fake.generate([[5, 6]], SamplingConfig(n=1, max_new_tokens=2), seed=0)
    assert (model_dir / CALLS_FILE).read_text().startswith("generate 1 prompts")
    with pytest.raises(ConfigError, match="neither a known backend"):
        EngineConfig(backend="vlm").validate()
    with pytest.raises(ConfigError, match="cannot import"):
        build_engine(EngineConfig(backend="no_such_module:build"), source)


def test_load_weights_from_path_reads_a_saved_folder(tiny, tmp_path):
    """An engine given a saved folder serves its weights (the same greedy tokens as the model saved)."""
    model, tokenizer = tiny
    other = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=9),
                             len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine = GenerationEngine(copy.deepcopy(model), tokenizer.eos_token_id, tokenizer.pad_token_id)
    engine.save_pretrained(tmp_path / "saved")
    GenerationEngine(other, tokenizer.eos_token_id, tokenizer.pad_token_id).save_pretrained(tmp_path / "other")
    greedy = SamplingConfig(n=1, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    before = engine.generate(_prompts(tokenizer), greedy)
    assert engine.load_weights_from_path(tmp_path / "other", version=4) > 0 and engine.policy_version == 4
    assert engine.generate(_prompts(tokenizer), greedy) != before
    engine.load_weights_from_path(tmp_path / "saved")
    assert [c.token_ids for c in engine.generate(_prompts(tokenizer), greedy)] == [c.token_ids for c in before]


def test_a_failing_rollout_function_is_one_rollout_error_naming_it(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(copy.deepcopy(model), tokenizer.eos_token_id, tokenizer.pad_token_id)

    def broken(request):
        yield from ()
        raise KeyError("turn")

    request = RolloutRequest(engine, _prompts(tokenizer), SamplingConfig(n=1, max_new_tokens=2), seed=0)
    with pytest.raises(RolloutError, match="rollout function my.module:fn raised KeyError: 'turn'"):
        list(checked_rollout(broken(request), 4, 1, "my.module:fn"))


def test_rewards_read_the_final_turn_of_a_multi_turn_completion():
    from gcore_rl.controller.program import final_turn

    c = Completion(0, [1], [5, 6, 7, 8, 9, 10], [-1.0, -1.0, 0.0, 0.0, -1.0, -1.0], "stop", loss_mask=[1, 1, 0, 0, 1, 1])
    assert final_turn(c) == [9, 10]
    assert final_turn(Completion(0, [1], [5, 6], [-1.0, -1.0], "stop")) == [5, 6]
    ends_inserted = Completion(0, [1], [5, 6, 7], [-1.0, 0.0, 0.0], "length", loss_mask=[1, 0, 0])
    assert final_turn(ends_inserted) == [5]
