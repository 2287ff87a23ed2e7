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


def test_sizes_and_copies_are_those_of_the_changelog_codec() -> None:
    """A table value is measured as the bytes Faust's json codec puts on the changelog, and a copy of it equals what a
    table recovered from that changelog holds (tuples as lists, non-text keys as text), sharing nothing."""
    from faust.serializers import codecs

    from rlstream.streams.app import DetachedValues
    from rlstream.streams.staging import changelog_copy

    value = {"m": {"0": [["trajectories", 1, 7], 0.5]}, "ids": ("a", "é"), 3: None}
    written = codecs.get_codec("json").dumps(value)
    assert json_size(value) == len(written)
    assert changelog_copy(value) == codecs.get_codec("json").loads(written) == {
        "m": {"0": [["trajectories", 1, 7], 0.5]}, "ids": ["a", "é"], "3": None}
    table: dict[str, object] = {}
    view = DetachedValues(table)
    view["g"] = value
    value["m"]["0"][1] = 1.0  # changed after the write: the table keeps what was written
    read = view["g"]
    read["m"]["0"][1] = 2.0  # changed after the read: the table keeps it too
    assert table["g"]["m"]["0"][1] == 0.5 and view["g"]["m"]["0"][1] == 0.5
