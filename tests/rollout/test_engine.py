"""Generation engine: KV-cache sampling, finish reasons, and log-prob parity with the trainer."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from gcore_rl.records import build_token_batch
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.rollout.sampling import SamplingConfig, filter_logits
from gcore_rl.training.logprobs import token_logprobs


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=3),
                             len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    return model.eval(), tokenizer


def _prompts(tokenizer):
    return [tokenizer.encode(p, add_special_tokens=False) for p in ["12+7=", "3+45=", "999+1=", "a>"]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_trainer_recompute(tiny, temperature):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    params = SamplingConfig(n=3, max_new_tokens=12, temperature=temperature, top_p=0.9, top_k=20)
    completions = engine.generate(_prompts(tokenizer), params, seed=0)
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature)
    gap = ((recomputed - batch.rollout_logprobs).abs() * batch.response_mask).max()
    assert gap < 1e-4
    # ragged lengths: the parity must hold across rows that finished at different steps
    assert len({len(c.token_ids) for c in completions}) > 1


def test_engine_shapes_order_and_finish_reasons(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_prompts=3)
    prompts = _prompts(tokenizer)
    completions = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=6), seed=1)
    assert len(completions) == 8
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2, 3, 3]
    for c in completions:
        assert c.prompt_ids == prompts[c.prompt_index]
        assert len(c.token_ids) == len(c.logprobs) <= 6
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tokenizer.eos_token_id
            assert tokenizer.eos_token_id not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 6 and tokenizer.eos_token_id not in c.token_ids


def test_greedy_matches_full_recompute_argmax(tiny):
    """Greedy decoding with the cache equals argmax decoding without any cache."""
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompt = tokenizer.encode("12+34=", add_special_tokens=False)
    completion = engine.generate([prompt], SamplingConfig(n=1, max_new_tokens=8, temperature=0.0))[0]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(len(completion.token_ids)):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
            if seq[-1] == tokenizer.eos_token_id:
                break
    assert seq[len(prompt):] == completion.token_ids


def test_seeded_generation_is_reproducible(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    params = SamplingConfig(n=4, max_new_tokens=8)
    first = [c.token_ids for c in engine.generate(_prompts(tokenizer), params, seed=5)]
    second = [c.token_ids for c in engine.generate(_prompts(tokenizer), params, seed=5)]
    assert first == second


def test_load_weights_changes_outputs_and_version(tiny):
    model, tokenizer = tiny
    other = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=4),
                             len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine = GenerationEngine(build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=3),
                                               len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id),
                              tokenizer.eos_token_id, tokenizer.pad_token_id)
    updated = engine.load_weights(other.named_parameters())
    assert updated == len(list(other.parameters()))
    assert engine.policy_version == 1
    for (name, p), (_, q) in zip(engine.model.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    with pytest.raises(KeyError, match="no parameter"):
        engine.load_weights([("not.a.param", torch.zeros(1))])


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(top2).tolist() == [[True, True, False, False]]
    # mass before token: 0, .5, .8, .95 → with top_p=0.8 keep tokens 0 and 1 only
    nucleus = filter_logits(logits, top_k=0, top_p=0.8)
    assert torch.isfinite(nucleus).tolist() == [[True, True, False, False]]
    nucleus = filter_logits(logits, top_k=0, top_p=0.81)
    assert torch.isfinite(nucleus).tolist() == [[True, True, True, False]]


def _fresh_engine(tiny) -> GenerationEngine:
    model, tokenizer = tiny
    copy = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=3),
                            len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    copy.load_state_dict(model.state_dict())
    return GenerationEngine(copy.eval(), tokenizer.eos_token_id, tokenizer.pad_token_id)


def test_stream_yields_each_completion_once_as_it_finishes(tiny):
    engine = _fresh_engine(tiny)
    prompts = _prompts(tiny[1])
    params = SamplingConfig(n=3, max_new_tokens=10)
    chunks = list(engine.generate_stream(prompts, params, seed=4))
    streamed = [c for chunk in chunks for c in chunk]
    assert sorted((c.prompt_index, c.sample_index) for c in streamed) == [(p, s) for p in range(4) for s in range(3)]
    # finish order: completions that stopped earlier are yielded in earlier chunks
    lengths = [max(len(c.token_ids) for c in chunk) for chunk in chunks]
    assert lengths == sorted(lengths) and len(chunks) > 1
    batch = engine.generate(prompts, params, seed=4)
    assert [(c.prompt_index, c.sample_index) for c in batch] == [(p, s) for p in range(4) for s in range(3)]
    by_key = {(c.prompt_index, c.sample_index): c.token_ids for c in streamed}
    assert [c.token_ids for c in batch] == [by_key[(c.prompt_index, c.sample_index)] for c in batch]


def test_sleep_offload_and_wake_restore_the_same_engine(tiny):
    engine = _fresh_engine(tiny)
    prompts = _prompts(tiny[1])
    params = SamplingConfig(n=2, max_new_tokens=8)
    before = engine.generate(prompts, params, seed=2)
    released = engine.sleep("offload")
    assert released == engine.weight_bytes() > 0 and engine.state == "offloaded"
    assert engine.sleep("offload") == 0  # already asleep
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, params, seed=2)
    engine.wake()
    after = engine.generate(prompts, params, seed=2)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


def test_discarded_weights_must_be_reloaded_before_generating(tiny):
    engine = _fresh_engine(tiny)
    weights = {k: v.clone() for k, v in engine.model.named_parameters()}
    prompts = _prompts(tiny[1])
    params = SamplingConfig(n=2, max_new_tokens=8)
    before = engine.generate(prompts, params, seed=5)
    engine.sleep("discard")
    assert all(p.numel() == 0 for p in engine.model.parameters())  # the memory is really gone
    engine.wake()
    with pytest.raises(RuntimeError, match="discarded"):
        engine.generate(prompts, params, seed=5)
    with pytest.raises(RuntimeError, match="only 1 of"):
        engine.load_weights(list(weights.items())[:1])
    engine.load_weights(weights.items())
    assert [c.token_ids for c in engine.generate(prompts, params, seed=5)] == [c.token_ids for c in before]


def test_discarding_an_offloaded_engine_drops_its_host_copy(tiny):
    engine = _fresh_engine(tiny)
    engine.sleep("offload")
    assert engine.sleep("discard") == 0 and engine.state == "discarded"
    assert all(p.numel() == 0 for p in engine.model.parameters())
