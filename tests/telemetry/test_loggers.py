"""`run.loggers`: every backend gets the same metric names and values, read back with each backend's own reader."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from gcore_rl.errors import ConfigError
from gcore_rl.telemetry import loggers
from gcore_rl.telemetry.loggers import check_loggers, open_loggers
from gcore_rl.telemetry.metrics import read_metrics

RECORDS = [(1, {"reward/mean": 0.25, "time/generate": 1.5, "accuracy": float("nan")}),
           (2, {"reward/mean": 0.75, "time/generate": 1.25, "accuracy": 0.5})]
"""Two steps; NaN is null in metrics.jsonl and absent elsewhere; every value is exact in float32 (TensorBoard)."""


def expected(name: str) -> list[tuple[int, float]]:
    return [(step, metrics[name]) for step, metrics in RECORDS if metrics[name] == metrics[name]]


def write_all(run_dir: Path, names: list[str]) -> None:
    with open_loggers(names, run_dir, config={"run": {"steps": 2}}) as sink:
        for step, metrics in RECORDS:
            sink.write(step, metrics)


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B with no network and no login, its settings and caches inside tmp_path."""
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
                       "WANDB_CACHE_DIR": tmp_path / "wandb-cache", "WANDB_DATA_DIR": tmp_path / "wandb-data"}.items():
        monkeypatch.setenv(var, str(value))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_jsonl_alone_writes_what_metrics_writer_writes(tmp_path):
    write_all(tmp_path, ["jsonl"])
    records = read_metrics(tmp_path)
    assert [(r["step"], r["reward/mean"], r["accuracy"]) for r in records] == [(1, 0.25, None), (2, 0.75, 0.5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_tensorboard_event_file_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_all(tmp_path, ["tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward/mean", "time/generate", "accuracy"}
    for name in ("reward/mean", "time/generate", "accuracy"):
        assert [(e.step, e.value) for e in events.Scalars(name)] == expected(name)
    assert len(read_metrics(tmp_path)) == 2  # metrics.jsonl is written as well


def test_a_resumed_run_replaces_the_tensorboard_steps_it_writes_again(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open_loggers(["tensorboard"], tmp_path) as sink:  # a run killed after step 3, its checkpoint at step 1
        for step in (1, 2, 3):
            sink.write(step, {"loss": float(step)})
    with open_loggers(["tensorboard"], tmp_path, first_step=2) as sink:  # the resumed run writes 2 and 3 again
        for step in (2, 3, 4):
            sink.write(step, {"loss": 10.0 * step})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file.

    The SDK no longer ships a Python reader for it (its Go core does the reading), so this follows
    the file's documented layout: a 7-byte header, then LevelDB log blocks of 32 KiB whose chunks
    each carry a 7-byte header (CRC, little-endian length, type 1 full / 2 first / 3 middle / 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", header
    while pos + header <= len(data):
        room = block - pos % block
        if room < header:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if kind == 0:  # zero padding at the end of a block
            pos += room
            continue
        chunk, pos = data[pos + header:pos + header + length], pos + header + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run_reads_back(tmp_path, offline_wandb):
    write_all(tmp_path, ["wandb"])
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    history = []
    for record in wandb_records(run_files[0]):
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    for name in ("reward/mean", "time/generate", "accuracy"):
        assert [(row["_step"], row[name]) for row in history if name in row] == expected(name)
    assert wandb_children() == []  # finish() and teardown() stopped W&B's service process


def wandb_children() -> list[str]:
    """Command lines of this process's child processes that belong to W&B (Linux /proc)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if "wandb" in cmdline:
                    found.append(cmdline)
        except OSError:  # the process ended meanwhile
            continue
    return found


def test_mlflow_file_store_reads_back(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # no network
    write_all(tmp_path, ["jsonl", "mlflow"])
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gcore-rl").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["run.steps"] == "2"
    for name in ("reward/mean", "time/generate", "accuracy"):
        history = client.get_metric_history(run.info.run_id, name.replace("/", "."))  # the file store's names
        assert sorted((m.step, m.value) for m in history) == expected(name)


def test_unknown_logger_names_the_key_and_the_valid_ones():
    with pytest.raises(ConfigError) as raised:
        check_loggers(["jsonl", "csv"], "run.loggers")
    assert raised.value.key == "run.loggers"
    assert "csv" in str(raised.value) and "tensorboard, wandb, mlflow" in str(raised.value)


def test_missing_package_names_the_extra_to_install(monkeypatch):
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError) as raised:
        check_loggers(["jsonl", "wandb"], "run.loggers")
    assert "pip install 'gcore-rl[wandb]'" in str(raised.value)


class _Broken:
    """A sink whose writes fail, as a logger whose server went away."""

    def __init__(self) -> None:
        self.writes = 0
        self.closed = False

    def write(self, step, metrics) -> None:
        self.writes += 1
        raise ConnectionError("tracking server gone")

    def close(self) -> None:
        self.closed = True


def test_a_failing_optional_logger_is_dropped_and_the_record_goes_on(tmp_path, capsys):
    broken = _Broken()
    fan = loggers.FanOut([loggers.MetricsWriter(tmp_path), broken])
    for step in (1, 2, 3):
        fan.write(step, {"reward/mean": 0.5})
    fan.close()
    assert broken.writes == 1 and broken.closed  # tried once, then closed and left out
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert "ConnectionError" in capsys.readouterr().err


def test_a_logger_that_cannot_start_is_a_config_error_and_leaves_nothing_open(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no API key configured")

    monkeypatch.setattr(loggers, "TensorBoardSink", refuse)
    monkeypatch.setattr(loggers, "check_loggers", lambda names, key: None)
    with pytest.raises(ConfigError) as raised:
        open_loggers(["jsonl", "tensorboard"], tmp_path, key="run.loggers")
    assert raised.value.key == "run.loggers" and "no API key configured" in str(raised.value)
