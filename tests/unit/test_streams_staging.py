"""A record's table writes are staged, measured as changelog records, and applied whole or not at all."""
from __future__ import annotations

from rlstream.streams.staging import StagedWrites, json_size, oversized_writes


def test_staged_writes_are_seen_but_reach_the_table_only_on_apply() -> None:
    table = {"a": 1, "b": 2}
    staged = StagedWrites(table)
    staged["c"] = 3
    staged["a"] = 10
    del staged["b"]
    assert dict(staged) == {"a": 10, "c": 3} and "b" not in staged and staged.get("b") is None and len(staged) == 2
    assert table == {"a": 1, "b": 2}  # discarded staging leaves the table as it was
    staged.apply()
    assert table == {"a": 10, "c": 3} and staged.changes == {}


def test_oversized_writes_measure_key_and_value() -> None:
    staged = StagedWrites({})
    staged["small"] = {"m": "x" * 10}
    staged["big"] = {"m": "x" * 1000}
    assert oversized_writes(staged, 500) == [("big", json_size("big") + json_size({"m": "x" * 1000}))]
    exact = json_size("t") + json_size({"m": "y" * 990})  # the limit is inclusive
    members = StagedWrites({})
    members["t"] = {"m": "y" * 990}
    assert oversized_writes(members, exact) == []
    assert oversized_writes(members, exact - 1) == [("t", exact)]
