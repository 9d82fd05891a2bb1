"""Prompts measured against the policy's context: error naming the row, truncation, dropping."""

from __future__ import annotations

import pytest

from gcore_rl.data.lengths import PromptRoom, fit_prompts
from gcore_rl.data.prompts import PromptEncoder
from gcore_rl.errors import ConfigError, DataError
from gcore_rl.models.tiny import build_char_tokenizer

ROOM = PromptRoom(positions=16, max_new_tokens=6, model_path="m")  # 10 prompt tokens fit
ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "123456789+12345=", "answer": "x"}, {"prompt": "2+2=", "answer": "4"}]


@pytest.fixture(scope="module")
def prompts():
    return PromptEncoder(build_char_tokenizer())


def test_error_names_the_global_row_and_the_limit(prompts):
    with pytest.raises(DataError, match=r"prompt file p\.jsonl, row 3: the prompt has 16 tokens but only 10 fit.*"
                                        r"max_position_embeddings=16.*data\.overlong_prompts"):
        fit_prompts(ROWS, prompts, ROOM, "error", "prompt file p.jsonl", range(1, 9, 2))


def test_truncate_keeps_the_last_tokens_and_counts(prompts):
    fitted = fit_prompts(ROWS, prompts, ROOM, "truncate", "s", range(3))
    assert [row["prompt"] for row in fitted.rows] == ["1+1=", "789+12345=", "2+2="]
    assert fitted.rows[1]["answer"] == "x"
    assert fitted.ids == [0, 1, 2]
    assert fitted.metrics() == {"data/prompts_truncated": 1.0, "data/prompts_dropped": 0.0}


def test_drop_leaves_the_row_out_and_fails_when_none_is_left(prompts):
    fitted = fit_prompts(ROWS, prompts, ROOM, "drop", "s", range(10, 13))
    assert fitted.rows == [ROWS[0], ROWS[2]]
    assert fitted.ids == [10, 12]  # the global rows of the kept ones
    assert fitted.dropped == 1
    with pytest.raises(DataError, match="left none"):
        fit_prompts(ROWS[1:2], prompts, ROOM, "drop", "s", range(1))


def test_without_a_known_limit_every_row_stays(prompts):
    room = PromptRoom(positions=None, max_new_tokens=6, model_path="m")
    assert fit_prompts(ROWS, prompts, room, "error", "s", range(3)).rows == ROWS


def test_a_completion_that_fills_the_context_is_a_config_error():
    with pytest.raises(ConfigError, match="sampling.max_new_tokens"):
        PromptRoom(positions=8, max_new_tokens=8, model_path="m").budget()


def test_the_smallest_limit_binds_and_is_named():
    """The model's context, the trainer's token budget per pass and a vLLM server's max_model_len: the smallest binds."""
    assert PromptRoom(positions=64, max_new_tokens=8, model_path="m").budget() == 56
    served = PromptRoom(positions=64, max_new_tokens=8, model_path="m", token_budget=32, engine_limit=16)
    assert served.budget() == 8 and "engine.vllm.max_model_len=16" in served.describe()
    assert "max_tokens_per_micro_batch=32" in PromptRoom(positions=64, max_new_tokens=8, model_path="m", token_budget=32,
                                                         engine_limit=48).describe()
    assert PromptRoom(positions=None, max_new_tokens=8, model_path="m", engine_limit=16).budget() == 8
    with pytest.raises(ConfigError, match="engine.vllm.max_model_len=8"):
        PromptRoom(positions=64, max_new_tokens=8, model_path="m", engine_limit=8).budget()


def test_a_rollout_generates_up_to_the_vllm_servers_limit_when_it_is_smaller(tmp_path):
    from gcore_rl.config import JobConfig, engine_context
    from gcore_rl.configlib import load_config
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", TinyModelConfig(hidden_size=16, num_layers=1, intermediate_size=32,
                                                                max_positions=64))
    job = [f"model.path={model}"]
    assert engine_context(load_config(JobConfig, None, job)) == 64
    assert engine_context(load_config(JobConfig, None, [*job, "engine.vllm.max_model_len=32"])) == 64  # builtin: unread
    assert engine_context(load_config(JobConfig, None, [*job, "engine.backend=vllm", "engine.vllm.max_model_len=32"])) == 32
    assert engine_context(load_config(JobConfig, None, [*job, "engine.backend=vllm", "engine.vllm.max_model_len=128"])) == 64
