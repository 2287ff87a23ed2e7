"""``learner.report_to``: each learner step's figures written to experiment trackers too (besides the ``metrics``
topic), under transformers' names: ``tensorboard``, ``wandb``, ``mlflow``.

A tracker whose package is missing fails the learner at start-up (:func:`check_report_to`), naming the package,
rather than after the first step. TensorBoard is written with ``torch.utils.tensorboard`` (which needs the
``tensorboard`` package), else ``tensorboardX``, as transformers' ``TensorBoardCallback`` does.
"""
from __future__ import annotations

import importlib
import math
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

from rlstream.transport.log import get_logger

log = get_logger(__name__)

#: The trackers and, for each, the modules tried in order and the package(s) that provide them.
TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("torch.utils.tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
}
#: What else provides a tracker's module.
ALTERNATIVES = {"tensorboard": " (or tensorboardX)"}


class ReportingError(RuntimeError):
    """A tracker of ``learner.report_to`` that cannot be used (unknown, or its package is not installed)."""


class Reporter(Protocol):
    """Where step figures go besides the metrics topic."""

    name: str

    def log(self, figures: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _import_first(modules: Sequence[str]) -> Any | None:
    for module in modules:
        try:
            return importlib.import_module(module)
        except (ImportError, AttributeError):  # old torch.utils.tensorboard fails on distutils with AttributeError
            continue
    return None


def check_report_to(report_to: Sequence[str]) -> None:
    """Raise :class:`ReportingError` naming every tracker of ``report_to`` that is unknown or not installed."""
    problems = []
    for name in report_to:
        if name not in TRACKERS:
            problems.append(f"unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
            continue
        modules, package = TRACKERS[name]
        if _import_first(modules) is None:
            problems.append(f"learner.report_to has {name!r} but the {package} package is not installed: "
                            f"pip install {package}{ALTERNATIVES.get(name, '')}")
    if "mlflow" in report_to and not problems:
        problems += mlflow_store_problems()
    if problems:
        raise ReportingError("; ".join(problems))


#: URI schemes of MLflow's database stores (they need ``alembic`` and ``sqlalchemy``, which mlflow-skinny lacks)
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def mlflow_store_problems() -> list[str]:
    """What stops MLflow from opening its tracking store, found before anything is loaded: a database store (MLflow's
    default when ``MLFLOW_TRACKING_URI`` is not set) without its packages."""
    from importlib.util import find_spec

    from mlflow.tracking import get_tracking_uri

    uri = get_tracking_uri()
    scheme = uri.partition(":")[0].split("+")[0].lower()
    source = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else \
        "MLflow's default store (MLFLOW_TRACKING_URI is not set)"
    todo = "set MLFLOW_TRACKING_URI to a tracking server (http://host:5000) or a file store (file:./mlruns, with " \
        "MLFLOW_ALLOW_FILE_STORE=true)"
    if scheme in DATABASE_SCHEMES:
        missing = [m for m in ("sqlalchemy", "alembic") if find_spec(m) is None]
        if missing:
            return [f"learner.report_to has 'mlflow' but {source} is the database {uri}, which needs "
                    f"{' and '.join(missing)} (pip install mlflow, not mlflow-skinny): {todo}"]
    return []


def _finite(figures: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in figures.items() if math.isfinite(float(v))}


class TensorBoardReporter:
    """Scalars in TensorBoard event files under ``log_dir`` (one tag per metric name, x = learner step)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        module = _import_first(TRACKERS["tensorboard"][0])
        if module is None:  # checked at start-up; kept for direct use
            raise ReportingError("tensorboard (or tensorboardX) is not installed")
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(log_dir)
        self.writer = module.SummaryWriter(log_dir=str(log_dir))

    def log(self, figures: dict[str, float], step: int) -> None:
        for tag, value in figures.items():
            self.writer.add_scalar(tag, float(value), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """A Weights & Biases run (project from ``WANDB_PROJECT``, as transformers does; name = the run id)."""

    name = "wandb"

    def __init__(self, run_name: str, config: dict[str, Any]) -> None:
        import os

        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rlstream"), name=run_name, config=config)

    def log(self, figures: dict[str, float], step: int) -> None:
        self.run.log(dict(figures), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowReporter:
    """An MLflow run in the tracking URI of the environment (``MLFLOW_TRACKING_URI``; run name = the run id). MLflow 3
    opens a local file store (``file:`` URI) only with ``MLFLOW_ALLOW_FILE_STORE=true``; ``mlflow-skinny`` (the
    ``tracking`` extra) serves a tracking server or a file store, a database store needs the full ``mlflow``."""

    name = "mlflow"

    def __init__(self, run_name: str, config: dict[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})

    def log(self, figures: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(_finite(figures), step=step)  # MLflow refuses NaN/inf

    def close(self) -> None:
        self.mlflow.end_run()


class Reporters:
    """The trackers of ``learner.report_to``; a tracker that fails while logging is logged and dropped (a tracker
    never stops training). A tracker whose run cannot be started (:meth:`open`) raises :class:`ReportingError`."""

    def __init__(self, reporters: Sequence[Reporter]) -> None:
        self.reporters = list(reporters)

    @classmethod
    def open(cls, report_to: Sequence[str], *, log_dir: Path, run_name: str,
             config: dict[str, Any] | None = None) -> "Reporters":
        check_report_to(report_to)
        out: list[Reporter] = []
        for name in dict.fromkeys(report_to):
            try:
                if name == "tensorboard":
                    out.append(TensorBoardReporter(log_dir))
                elif name == "wandb":
                    out.append(WandbReporter(run_name, config or {}))
                elif name == "mlflow":
                    out.append(MlflowReporter(run_name, config or {}))
            except Exception as exc:  # noqa: BLE001 - e.g. no W&B API key, an MLflow store refused: say which
                cls(out).close()
                raise ReportingError(f"learner.report_to {name!r}: the run could not be started: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return cls(out)

    def log(self, figures: dict[str, float], step: int) -> None:
        for reporter in list(self.reporters):
            try:
                reporter.log(figures, step)
            except Exception as exc:  # noqa: BLE001 - a tracker must not stop training
                log.error("tracker failed; it is dropped", tracker=reporter.name, error=str(exc))
                self.reporters.remove(reporter)

    def close(self) -> None:
        for reporter in self.reporters:
            try:
                reporter.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("tracker did not close cleanly", tracker=reporter.name, error=str(exc))
        self.reporters = []
