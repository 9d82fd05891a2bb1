"""Where step metrics go: ``metrics.jsonl`` and, on request, TensorBoard, Weights & Biases and MLflow.

Each backend is a `MetricsSink` (``write(step, metrics)`` and ``close()``); `open_loggers` builds
the ones a run lists in its ``loggers`` key and fans every record out to all of them under the
same metric names (``reward/mean``, ``time/generate``...). The optional backends are imported only
when asked for, and all of them write inside the run directory by default:

- ``tensorboard``: event files in ``RUN_DIR/tensorboard`` (`torch.utils.tensorboard.SummaryWriter`);
- ``wandb``: an offline run in ``RUN_DIR/wandb`` unless ``WANDB_MODE`` says otherwise (upload it
  later with ``wandb sync``); ``WANDB_PROJECT`` names the project (default ``gcore-rl``);
- ``mlflow``: a local file store ``RUN_DIR/mlruns`` (where '/' in a name becomes '.', see
  `MlflowSink`) unless ``MLFLOW_TRACKING_URI`` names another store; ``MLFLOW_EXPERIMENT_NAME``
  names the experiment (default ``gcore-rl``).

Non-finite values are ``null`` in metrics.jsonl and are left out of the other backends, which
also leave out values that are not numbers.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from gcore_rl.errors import ConfigError
from gcore_rl.telemetry.metrics import MetricsWriter

__all__ = ["LOGGER_NAMES", "FanOut", "MetricsSink", "check_loggers", "default_loggers", "open_loggers"]

LOGGER_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow")
"""Valid entries of a ``loggers`` key."""

_PACKAGE_OF = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The module a logger needs (the `gcore-rl[NAME]` extra of the same name installs it)."""


def default_loggers() -> list[str]:
    return ["jsonl"]


class MetricsSink(Protocol):
    """A destination of step metrics."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def check_loggers(names: Sequence[str], key: str = "loggers") -> None:
    """Raise ConfigError(key) for an unknown or repeated logger name, or one whose package is not installed."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ConfigError(key, f"must be a list of logger names from {list(LOGGER_NAMES)}, got {names!r}")
    for name in names:
        if name not in LOGGER_NAMES:
            raise ConfigError(key, f"unknown logger {name!r}; valid loggers are {', '.join(LOGGER_NAMES)}")
    repeated = sorted({name for name in names if list(names).count(name) > 1})
    if repeated:
        raise ConfigError(key, f"lists {', '.join(repeated)} more than once")
    for name in names:
        package = _PACKAGE_OF.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(key, f"logger {name!r} needs the `{package}` package, which is not installed; "
                              f"install it with `pip install 'gcore-rl[{name}]'`, or remove {name!r} from {key}")


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric values of a record (bools count as 0/1; None, NaN, inf and text are left out)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if value is None or isinstance(value, str):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[name] = number
    return out


class TensorBoardSink:
    """Scalars in TensorBoard event files under `log_dir`, one tag per metric name.

    A run resumed at step `first_step` (> 1) adds a new event file that tells TensorBoard to drop
    the earlier files' events from that step on (`purge_step`): the steps the killed run recorded
    after its checkpoint are written again by the resumed run, and must not show twice.
    """

    def __init__(self, log_dir: Path, first_step: int = 1):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_step if first_step > 1 else None)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        for name, value in _numbers(metrics).items():
            self._writer.add_scalar(name, value, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run in `run_dir/wandb`, offline unless the ``WANDB_MODE`` variable says otherwise.

    `finish` ends the run and `wandb.teardown` stops W&B's background service process.
    """

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any] | None):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "gcore-rl"), name=run_name, dir=str(run_dir),
                               mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
                               config=dict(config or {}), reinit="create_new")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._run.log(_numbers(metrics), step=int(step))

    def close(self) -> None:
        self._run.finish()
        self._wandb.teardown()


class MlflowSink:
    """An MLflow run; by default in the local file store `run_dir/mlruns`, else in ``MLFLOW_TRACKING_URI``.

    The file store keeps each metric in a file whose path is the metric's name, so ``time/rollout``
    and ``time/rollout/reward`` cannot both exist there: in that store '/' becomes '.'
    (``time.rollout.reward``). Other stores (a database, a server) keep the names as they are.
    """

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any] | None):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        self._slash = "/"
        if not uri:
            uri = Path(logger_location("mlflow", run_dir)).resolve().as_uri()
            self._slash = "."
            # MLflow 3 keeps the file store in maintenance mode behind this switch; it needs no database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "gcore-rl")
        experiment = self._client.get_experiment_by_name(experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(experiment_name))
        self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        if config:
            from mlflow.entities import Param

            self._client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in _flat(config).items()])

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(name.replace("/", self._slash), value, now, int(step))
                 for name, value in _numbers(metrics).items()]
        if batch:
            self._client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (``train.lr``), the form MLflow parameters take."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


class FanOut:
    """Writes each record to every sink; `close` closes them all, in order, even when one fails.

    The first sink is the run's own record (``metrics.jsonl``): its failures propagate. An optional
    sink after it that fails to write (a tracking server gone away, a full disk under its folder) is
    closed and dropped with a warning, so an outside logger never stops a training run.
    """

    def __init__(self, sinks: Iterable[MetricsSink]):
        self.sinks = list(sinks)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        for index, sink in enumerate(list(self.sinks)):
            if index == 0:
                sink.write(step, metrics)
                continue
            try:
                sink.write(step, metrics)
            except Exception as exc:  # one failing logger must not stop the others or the run
                print(f"warning: logger {type(sink).__name__} failed at step {step} ({type(exc).__name__}: {exc}); "
                      "it is dropped for the rest of the run (metrics.jsonl goes on)", file=sys.stderr)
                self.sinks.remove(sink)
                try:
                    sink.close()
                except Exception:  # already failing; the warning above says why
                    pass

    def close(self) -> None:
        first: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # close the others before reporting it
                first = first or exc
        self.sinks = []
        if first is not None:
            raise first

    def __enter__(self) -> FanOut:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def logger_location(name: str, run_dir: str | Path) -> str:
    """Where the sink `name` (not ``jsonl``) writes for a run in `run_dir`: a folder, or MLflow's tracking URI
    when ``MLFLOW_TRACKING_URI`` names another store."""
    run_dir = Path(run_dir)
    if name == "mlflow":
        return os.environ.get("MLFLOW_TRACKING_URI") or str(run_dir / "mlruns")
    return str(run_dir / name)  # tensorboard/, wandb/ (W&B makes its own `wandb` folder under `dir`)


def open_loggers(names: Sequence[str], run_dir: str | Path, jsonl_path: str | Path | None = None,
                 config: Mapping[str, Any] | None = None, key: str = "loggers", first_step: int = 1) -> FanOut:
    """The JSON-lines file `jsonl_path` (default ``run_dir/metrics.jsonl``) and the other sinks
    `names` asks for, writing in `run_dir`; `config` is recorded with the W&B and MLflow runs.
    `first_step` is the step the run starts at (> 1 when it resumes from a checkpoint).

    The JSON lines are written whether or not `names` lists ``jsonl``: resuming a run, the report
    and the simulator's calibration read them.

    Raises ConfigError(key) for an unknown logger or a missing package. Sinks opened before one
    fails to open are closed again.
    """
    check_loggers(names, key)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_name = run_dir.resolve().name
    sinks: list[MetricsSink] = [MetricsWriter(jsonl_path if jsonl_path is not None else run_dir)]
    try:
        for name in names:
            if name == "jsonl":
                continue  # always written, first
            try:
                if name == "tensorboard":
                    sinks.append(TensorBoardSink(Path(logger_location(name, run_dir)), first_step))
                elif name == "wandb":
                    sinks.append(WandbSink(run_dir, run_name, config))
                else:
                    sinks.append(MlflowSink(run_dir, run_name, config))
            except ConfigError:
                raise
            except Exception as exc:  # e.g. W&B online without a key, an MLflow server that does not answer
                raise ConfigError(key, f"the {name} logger could not start ({type(exc).__name__}: {exc}); fix its "
                                  f"settings (environment variables such as WANDB_MODE or MLFLOW_TRACKING_URI) or "
                                  f"leave {name} out of {key}") from None
    except BaseException:
        FanOut(sinks).close()
        raise
    return FanOut(sinks)
