"""``learner.report_to``: step figures in TensorBoard event files; a tracker whose package is missing fails the
learner at start-up, naming the package."""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlstream.learner.reporting import Reporters, ReportingError, check_report_to
from rlstream.schemas.config import load_config
from rlstream.transport import metric_names as mn


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under ``log_dir`` (TFRecord framing, ``Event`` protos)."""
    try:
        from tensorboardX.proto.event_pb2 import Event
    except ImportError:
        from tensorboard.compat.proto.event_pb2 import Event  # type: ignore[no-redef]
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                scalar = value.simple_value if value.HasField("simple_value") else value.tensor.float_val[0]
                out.setdefault(value.tag, []).append((event.step, scalar))
    return out


def test_tensorboard_gets_the_step_figures(tmp_path: Path) -> None:
    check_report_to(["tensorboard"])  # tensorboardX is a dev dependency: a missing writer fails here, not skips
    reporters = Reporters.open(["tensorboard"], log_dir=tmp_path / "logs", run_name="r")
    reporters.log({mn.LEARNER_LOSS: 0.5, mn.LEARNER_CLIP_FRACTION: 0.25}, step=1)
    reporters.log({mn.LEARNER_LOSS: 0.25, mn.LEARNER_CLIP_FRACTION: 0.0}, step=2)
    reporters.close()
    scalars = _scalars(tmp_path / "logs")
    assert scalars[mn.LEARNER_LOSS] == [(1, 0.5), (2, 0.25)]
    assert scalars[mn.LEARNER_CLIP_FRACTION] == [(1, 0.25), (2, 0.0)]


def test_a_missing_tracker_package_fails_at_start_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rlstream.learner.service import Learner

    check_report_to([])
    for module in ("wandb", "mlflow", "torch.utils.tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, module, None)  # an import of it raises ImportError
    with pytest.raises(ReportingError, match=r"'wandb' but the wandb package is not installed: pip install wandb"):
        check_report_to(["wandb"])
    with pytest.raises(ReportingError, match=r"tensorboard package is not installed: pip install tensorboard "
                                             r"\(or tensorboardX\)"):
        check_report_to(["tensorboard"])
    cfg = load_config(None, [("learner.report_to", "[mlflow]"), ("learner.output_dir", str(tmp_path))])
    assert cfg.learner.report_to == ["mlflow"]
    with pytest.raises(ReportingError, match="mlflow package is not installed"):
        Learner(cfg)  # before any connection, lease or model load

    from rlstream.cli.app import app

    result = CliRunner().invoke(app, ["learner", "run", "-o", "learner.report_to", "[wandb]"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 1 and "wandb package is not installed" in result.output
