import json
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gcore_rl.data import sources
from gcore_rl.data.config import DataConfig
from gcore_rl.data.sources import attach_image_payload, load_eval_rows, load_prompt_rows, shard_row_indices
from gcore_rl.errors import ConfigError, DataError


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """Keep the Arrow cache of prompt files (under the temp dir) inside this test's tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize(("num_rows", "num_shards"), [(1, 1), (7, 1), (7, 3), (12, 4), (23, 4), (5, 5)])
def test_shards_are_disjoint_and_cover_all_rows(num_rows, num_shards):
    shards = [list(shard_row_indices(num_rows, i, num_shards)) for i in range(num_shards)]
    assert sorted(i for shard in shards for i in shard) == list(range(num_rows))
    assert all(shard == sorted(shard) for shard in shards)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert [shard[0] for shard in shards] == list(range(num_shards))


def test_bad_shard_arguments():
    for shard_index, num_shards in [(0, 0), (2, 2), (-1, 2)]:
        with pytest.raises(ValueError, match="num_shards|shard_index"):
            shard_row_indices(10, shard_index, num_shards)
        with pytest.raises(ValueError, match="num_shards|shard_index"):
            load_prompt_rows(DataConfig(task=None, path="never-read.jsonl"), shard_index, num_shards)
    with pytest.raises(DataError, match=r"2 prompt rows cannot be split over 3 shards"):
        shard_row_indices(2, 0, 3)
    with pytest.raises(DataError, match=r"4 prompt rows cannot be split over 5 shards"):
        load_prompt_rows(DataConfig(task="addition", num_prompts=4), 0, 5)


def test_task_shards_are_slices_of_all_rows():
    cfg = DataConfig(task="reversal", num_prompts=11, seed=2)
    rows = load_prompt_rows(cfg)
    for i in range(3):
        assert load_prompt_rows(cfg, i, 3) == rows[i::3]
    assert set(rows[0]) == {"prompt", "answer", "task"}


def test_image_payload_depends_only_on_the_row():
    cfg = DataConfig(task="addition", num_prompts=7, payload_image_size=4, seed=5)
    whole = [row["image"] for row in load_prompt_rows(cfg)]
    assert whole[0].shape == (3, 4, 4) and whole[0].dtype == np.uint8
    for i in range(3):
        for image, index in zip([row["image"] for row in load_prompt_rows(cfg, i, 3)], range(i, 7, 3), strict=True):
            assert np.array_equal(image, whole[index])
    assert not np.array_equal(whole[0], whole[1])
    assert attach_image_payload([{"a": 1}], [0], 0, 5) == [{"a": 1}]
    with pytest.raises(ValueError, match="row indices"):
        attach_image_payload([{"a": 1}], [0, 1], 4, 5)


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_file_shards_are_slices_of_all_rows(tmp_path, monkeypatch, writer):
    monkeypatch.setattr(sources, "_GATHER_BATCH_ROWS", 2)  # exercise gathering a shard in several batches
    path = writer(tmp_path / ("p.jsonl" if writer is write_jsonl else "p.parquet"),
                  [{"question": f"{i}+1=", "solution": i + 1, "id": i} for i in range(10)])
    cfg = DataConfig(task=None, path=str(path), prompt_field="question", answer_field="solution")
    rows = load_prompt_rows(cfg)
    assert rows[3] == {"id": 3, "prompt": "3+1=", "answer": "4"} and len(rows) == 10
    for i in range(4):
        assert load_prompt_rows(cfg, i, 4) == rows[i::4]
    caches = list((tmp_path / "tmp").glob("gcore_rl-datasets-*"))
    assert len(caches) == 1 and any(caches[0].rglob("*.arrow"))  # the Arrow cache lives under the temp dir
    with pytest.raises(DataError, match="10 prompt rows cannot be split over 11 shards"):
        load_prompt_rows(cfg, 0, 11)


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
    for shard_index in range(2):  # the whole file is checked and the row number is global
        with pytest.raises(DataError, match="row 2: prompt field `question` is missing"):
            load_prompt_rows(cfg, shard_index, 2)


def test_first_bad_row_of_either_field_is_reported(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "a", "answer": "1"},
        {"prompt": "b", "answer": None},
        {"prompt": None, "answer": "3"},
    ])
    with pytest.raises(DataError, match="row 1: answer field `answer` is missing"):
        load_prompt_rows(DataConfig(task=None, path=str(path)), 0, 3)
    chunked = tmp_path / "chunked.parquet"  # several Arrow chunks: the reported row is still global
    pq.write_table(pa.table({"prompt": [None if i == 5 else str(i) for i in range(8)]}), chunked, row_group_size=2)
    with pytest.raises(DataError, match="row 5: prompt field `prompt` is missing"):
        load_prompt_rows(DataConfig(task=None, path=str(chunked), answer_field=None), 1, 2)
    bools = write_parquet(tmp_path / "bools.parquet", [{"prompt": "a", "answer": True}])
    with pytest.raises(DataError, match=r"row 0: answer field `answer` is not a string or number \(got bool\)"):
        load_prompt_rows(DataConfig(task=None, path=str(bools)))


def test_non_string_prompt_is_rejected(tmp_path):
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["a", "b"]}), path)
    with pytest.raises(DataError, match=r"row 0: prompt field `prompt` is not a string \(got int\)"):
        load_prompt_rows(DataConfig(task=None, path=str(path)), 1, 2)


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
