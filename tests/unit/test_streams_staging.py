"""A record's table writes are staged, measured as changelog records, and applied whole or not at all."""
from __future__ import annotations

from rlstream.streams.staging import StagedWrites, base64_json_size, json_size, oversized_writes


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
    members = StagedWrites({})
    members["t"] = b"\x00" * 750
    assert base64_json_size(b"\x00" * 750) == 1002  # 1000 base64 characters and the JSON quotes
    assert oversized_writes(members, 1005, base64_json_size) == []  # the key "t" is 3 JSON bytes
    assert oversized_writes(members, 1004, base64_json_size) == [("t", 1005)]
