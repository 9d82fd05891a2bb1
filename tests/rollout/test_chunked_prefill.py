"""Chunked prefill (`engine.prefill_chunk_tokens`): an admission prefilled in forwards of a few columns, each
attending to the pool columns the earlier ones wrote, gives the completions and log-probs of one forward."""

from __future__ import annotations

import math

import pytest
import torch

from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.rollout.kv_cache import SlotKVCache, prefill_mask
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.rollout.scheduler import prefill_chunks

CHUNKS = [1, 3, 7]
# ragged lengths 2, 5, 6 and 13: every row but the longest is left-padded, and the chunks of 3 and 7 cut
# through the padding of some rows and the tokens of others
TEXTS = ["7=", "12+7=", "999+1=", "1234+5678+90="]
WIDTH = 13


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=3,
                                             arch=request.param),
                             len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert max(len(p) for p in prompts) == WIDTH
    return model.eval(), tokenizer, prompts


def _generate(tiny, chunk: int, params: SamplingConfig, **engine_args):
    model, tokenizer, prompts = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, prefill_chunk_tokens=chunk,
                              **engine_args)
    return engine.generate(prompts, params, seed=11), engine.last_stats


def _assert_same(completions, reference):
    assert [c.token_ids for c in completions] == [c.token_ids for c in reference]
    for c, r in zip(completions, reference, strict=True):
        assert c.logprobs == pytest.approx(r.logprobs, abs=1e-5, rel=0)


def test_chunks_cover_the_width_in_order():
    assert prefill_chunks(13, 0) == [(0, 13)]
    assert prefill_chunks(13, 13) == [(0, 13)] and prefill_chunks(13, 100) == [(0, 13)]
    assert prefill_chunks(13, 7) == [(0, 7), (7, 13)]
    assert prefill_chunks(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert prefill_chunks(3, 1) == [(0, 1), (1, 2), (2, 3)]


def test_a_chunks_mask_is_its_rows_of_the_whole_mask():
    start = torch.tensor([0, 2, 5])
    whole = prefill_mask(start, 6)
    assert prefill_mask(start, 6, first_col=4).shape == (3, 1, 2, 6)
    for first in range(6):
        for end in range(first + 1, 7):
            assert torch.equal(prefill_mask(start, end, first_col=first), whole[:, :, first:end, :end])
    # row 1 (start 2), query column 3: its own tokens at columns 2 and 3; padding query column 1 sees only itself
    assert prefill_mask(start, 4, first_col=3)[1, 0, 0].tolist() == [False, False, True, True]
    assert prefill_mask(start, 2, first_col=1)[1, 0, 0].tolist() == [False, True]


def test_a_chunk_must_start_inside_the_prefill():
    cache = SlotKVCache(2, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="column 5"):
        cache.plan_prefill(0, 2, 5, first_col=5)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_greedy_completions_and_logprobs_equal_one_forward(tiny, chunk):
    """One admission (every sample fits): the same tokens and log-probs; ceil(13 / chunk) prefill forwards
    instead of one, the same prefilled rows and token positions; n = 2 samples share each prefilled prompt."""
    params = SamplingConfig(n=2, max_new_tokens=8, temperature=0.0)
    whole, whole_stats = _generate(tiny, 0, params)
    chunked, stats = _generate(tiny, chunk, params)
    _assert_same(chunked, whole)
    assert whole_stats.prefills == 1 and stats.prefills == math.ceil(WIDTH / chunk)
    assert (stats.prefill_rows, stats.prefill_tokens) == (whole_stats.prefill_rows, whole_stats.prefill_tokens) == (4, 4 * WIDTH)
    assert stats.decode_steps == whole_stats.decode_steps


def test_a_chunk_as_wide_as_the_prompts_is_one_forward(tiny):
    params = SamplingConfig(n=1, max_new_tokens=4, temperature=0.0)
    _, stats = _generate(tiny, WIDTH, params)
    assert stats.prefills == 1


@pytest.mark.parametrize("chunk", CHUNKS)
def test_sampled_refilled_rows_equal_one_forward(tiny, chunk, monkeypatch):
    """Temperature 1, seeded, 3 rows refilled one at a time (admissions of several widths, each prefilled next
    to rows that are decoding): identical tokens, log-probs to 1e-5, and every admission of width w takes
    ceil(w / chunk) forwards."""
    widths: list[int] = []
    plan = SlotKVCache.plan_prefill

    def record(self, first_row, rows, width, first_col=0):
        widths.append(width)
        plan(self, first_row, rows, width, first_col)

    params = SamplingConfig(n=3, max_new_tokens=10, temperature=1.0)
    monkeypatch.setattr(SlotKVCache, "plan_prefill", record)
    whole, whole_stats = _generate(tiny, 0, params, max_num_seqs=3, min_admit=1)
    monkeypatch.setattr(SlotKVCache, "plan_prefill", plan)
    chunked, stats = _generate(tiny, chunk, params, max_num_seqs=3, min_admit=1)
    _assert_same(chunked, whole)
    assert len(widths) == whole_stats.prefills > 1 and len(set(widths)) > 1
    assert stats.prefills == sum(math.ceil(w / chunk) for w in widths)
    assert (stats.prefill_rows, stats.prefill_tokens) == (whole_stats.prefill_rows, whole_stats.prefill_tokens)


def test_a_negative_chunk_is_refused():
    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config
    from gcore_rl.errors import ConfigError

    with pytest.raises(ConfigError, match="engine.prefill_chunk_tokens"):
        load_config(JobConfig, None, ["engine.prefill_chunk_tokens=-1"])
    assert load_config(JobConfig, None, ["engine.prefill_chunk_tokens=64"]).engine.prefill_chunk_tokens == 64
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64),
                             len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, prefill_chunk_tokens=-1)
