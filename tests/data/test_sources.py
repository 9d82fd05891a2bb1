import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gcore_rl.data.config import DataConfig
from gcore_rl.data.sources import load_eval_rows, load_prompt_rows
from gcore_rl.errors import ConfigError, DataError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_synthetic_rows_and_eval_rows_differ():
    cfg = DataConfig(task="addition", num_prompts=20, eval_prompts=5, task_options={"digits": 3}, seed=4)
    cfg.validate()
    rows = load_prompt_rows(cfg)
    assert len(rows) == 20 and rows == load_prompt_rows(cfg)
    evals = load_eval_rows(cfg)
    assert len(evals) == 5
    assert evals != rows[:5]


def test_jsonl_with_custom_fields(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"question": "1+1=", "solution": "2", "level": 1},
        {"question": "2+5=", "solution": "7", "level": 2},
    ])
    cfg = DataConfig(task=None, path=str(path), prompt_field="question", answer_field="solution")
    cfg.validate()
    rows = load_prompt_rows(cfg)
    assert rows == [
        {"level": 1, "prompt": "1+1=", "answer": "2"},
        {"level": 2, "prompt": "2+5=", "answer": "7"},
    ]
    assert load_eval_rows(cfg) == []


def test_parquet_with_custom_prompt_field_and_no_answer(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["ab>", "cde>"], "id": [10, 11]}), path)
    cfg = DataConfig(task=None, path=str(path), prompt_field="text", answer_field=None)
    cfg.validate()
    rows = load_prompt_rows(cfg)
    assert rows == [{"id": 10, "prompt": "ab>"}, {"id": 11, "prompt": "cde>"}]


def test_missing_prompt_field_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"question": "1+1=", "answer": "2"},
        {"question": "2+2=", "answer": "4"},
        {"other": "x", "answer": "5"},
    ])
    cfg = DataConfig(task=None, path=str(path), prompt_field="question")
    with pytest.raises(DataError) as info:
        load_prompt_rows(cfg)
    message = str(info.value)
    assert str(path) in message
    assert "row 2" in message
    assert "`question`" in message


def test_non_string_prompt_is_rejected(tmp_path):
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["a", "b"]}), path)
    with pytest.raises(DataError, match="row 0"):
        load_prompt_rows(DataConfig(task=None, path=str(path)))


def test_missing_and_empty_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="nope.jsonl"):
        load_prompt_rows(DataConfig(task=None, path=str(missing)))
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match="no rows"):
        load_prompt_rows(DataConfig(task=None, path=str(empty)))


def test_missing_answer_column(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(DataError, match="answer_field"):
        load_prompt_rows(DataConfig(task=None, path=str(path)))


def test_config_validation():
    with pytest.raises(ConfigError) as info:
        DataConfig(task="addition", path="x.jsonl").validate()
    assert info.value.key == "task"
    with pytest.raises(ConfigError) as info:
        DataConfig(task=None, path=None).validate()
    assert info.value.key == "task"
    with pytest.raises(ConfigError) as info:
        DataConfig(task=None, path="prompts.csv").validate()
    assert info.value.key == "path"
    with pytest.raises(ConfigError) as info:
        DataConfig(num_prompts=0).validate()
    assert info.value.key == "num_prompts"
    assert info.value.with_prefix("data").key == "data.num_prompts"


def test_empty_and_malformed_jsonl(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        load_prompt_rows(DataConfig(task=None, path=str(empty)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"\n')
    with pytest.raises(DataError, match="broken.jsonl"):
        load_prompt_rows(DataConfig(task=None, path=str(broken), answer_field=None))
