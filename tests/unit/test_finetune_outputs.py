"""The finetune output files: exactly the NAT harness's keys, values computed from the epoch's groups, files kept
current after every epoch, and a plot with the filtered line and the curriculum axis."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.finetune.outputs import (CURRICULUM_KEYS, CURRICULUM_STATE, EPOCH_KEYS, PERCENTILE_LABEL, REWARD_HISTORY,
                                       REWARD_KEYS, REWARD_PLOT, TRAINING_METRICS, VALIDATION_HISTORY, VALIDATION_KEYS,
                                       FinetuneOutputs, curriculum_document, epoch_record, plot_series,
                                       validation_record)


def test_epoch_record_has_exactly_the_documented_keys_and_figures() -> None:
    groups = [[0.0, 1.0], [0.5, 0.5], [0.2, 0.6]]
    kept = [[0.0, 1.0]]
    record = epoch_record(3, "run-a", groups, kept, percentile=0.5)
    assert tuple(record) == EPOCH_KEYS
    assert record["epoch"] == 3 and record["run_id"] == "run-a"
    assert record["num_groups"] == 3 and record["num_trajectories"] == 6
    assert record["avg_reward"] == pytest.approx(2.8 / 6)
    assert (record["min_reward"], record["max_reward"]) == (0.0, 1.0)
    assert record["filtered_groups"] == 1 and record["filtered_trajectories"] == 2
    assert (record["filtered_avg_reward"], record["filtered_min_reward"], record["filtered_max_reward"]) == (0.5, 0.0, 1.0)
    assert record["curriculum_percentile"] == 0.5


def test_epoch_record_carries_curriculum_state_only_when_given_and_zeros_without_groups() -> None:
    state = {"current_percentile": 0.3, "last_expansion_epoch": -1}
    record = epoch_record(0, "r", [], [], 0.3, state)
    assert set(record) == set(EPOCH_KEYS) | {"curriculum_state"}
    assert record["curriculum_state"] == state
    assert record["num_groups"] == 0 and record["avg_reward"] == 0.0 and record["filtered_avg_reward"] == 0.0


def test_validation_and_curriculum_documents_have_the_documented_keys() -> None:
    record = validation_record(5, [0.2, 0.4, 0.9])
    assert tuple(record) == VALIDATION_KEYS
    assert record["num_examples"] == 3 and record["avg_reward"] == pytest.approx(0.5)
    assert (record["min_reward"], record["max_reward"]) == (0.2, 0.9)
    doc = curriculum_document(0.7, 4, 10, ["g2", "g1"], {"enabled": True})
    assert tuple(doc) == CURRICULUM_KEYS
    assert doc["included_groups"] == ["g2", "g1"] and doc["total_groups"] == 10


def test_outputs_are_rewritten_after_every_epoch(tmp_path: Path) -> None:
    out = FinetuneOutputs(tmp_path / "out")
    assert json.loads((tmp_path / "out" / REWARD_HISTORY).read_text()) == []
    assert json.loads((tmp_path / "out" / VALIDATION_HISTORY).read_text()) == []
    out.add_epoch(epoch_record(0, "r", [[0.0, 1.0]], [[0.0, 1.0]], 0.3))
    out.add_validation(validation_record(0, [0.5]))
    out.add_epoch(epoch_record(1, "r", [[1.0, 1.0]], [], 0.3))
    out.set_curriculum(curriculum_document(0.3, -1, 1, [], {}))
    lines = [json.loads(x) for x in (tmp_path / "out" / TRAINING_METRICS).read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [0, 1]
    history = json.loads((tmp_path / "out" / REWARD_HISTORY).read_text())
    assert [tuple(h) for h in history] == [REWARD_KEYS, REWARD_KEYS]
    assert [h["avg_reward"] for h in history] == [0.5, 1.0]
    assert json.loads((tmp_path / "out" / VALIDATION_HISTORY).read_text())[0]["num_examples"] == 1
    assert tuple(json.loads((tmp_path / "out" / CURRICULUM_STATE).read_text())) == CURRICULUM_KEYS
    png = out.plot("t")
    assert png == tmp_path / "out" / REWARD_PLOT and png.read_bytes()[:4] == b"\x89PNG"


def test_plot_draws_the_filtered_line_and_the_curriculum_percentile() -> None:
    epochs = [epoch_record(0, "r", [[0.0, 1.0]], [[0.0, 1.0]], 0.3), epoch_record(1, "r", [[0.2, 0.2]], [], 0.5),
              epoch_record(2, "r", [[0.0, 0.8]], [[0.0, 0.8]], 0.7)]
    series = plot_series(epochs, [validation_record(0, [0.1]), validation_record(3, [0.3])])
    assert series["training mean reward"] == ([0, 1, 2], [0.5, 0.2, 0.4])
    assert series["filtered mean reward (trained on)"] == ([0, 2], [0.5, 0.4])  # epochs that kept groups
    assert series["validation mean reward"] == ([0, 3], [0.1, 0.3])
    assert series[PERCENTILE_LABEL] == ([0, 1, 2], [0.3, 0.5, 0.7])
