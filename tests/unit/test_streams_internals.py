"""The Faust internals the exactly-once worker relies on are checked when it is built: present in the pinned
faust-streaming for both stores; a release without one fails at once, naming it, and the state wipe never
silently does nothing."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlstream.schemas.config import RlstreamConfig
from rlstream.streams.app import StreamsApp
from rlstream.streams.exactly_once import internals
from rlstream.streams.exactly_once.internals import UnsupportedLibraryVersion, check_internals
from rlstream.streams.exactly_once.state_reset import wipe_store


def build(tmp_path: Path, store: str = "memory") -> StreamsApp:
    cfg = RlstreamConfig()
    cfg.kafka.bootstrap_servers = "localhost:9092"  # never contacted: the app is only built
    cfg.streams.data_dir = str(tmp_path)
    cfg.streams.store = store  # type: ignore[assignment]
    return StreamsApp(cfg, "w0")


@pytest.mark.parametrize("store", ["memory", "rocksdb"])
def test_the_pinned_faust_has_every_internal(tmp_path: Path, store: str) -> None:
    streams = build(tmp_path, store)  # the constructor runs the check
    check_internals(streams.app, store)


def test_a_faust_without_one_fails_at_build_time_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    renamed = internals.Internal("faust Consumer", "_read_offset_v2", "moving Faust's read position back")
    monkeypatch.setattr(internals, "CONSUMER", [*internals.CONSUMER, renamed])
    with pytest.raises(UnsupportedLibraryVersion, match=r"faust Consumer\._read_offset_v2 \(moving Faust's read"):
        build(tmp_path)


def test_the_memory_wipe_empties_data_and_key_partitions(tmp_path: Path) -> None:
    streams = build(tmp_path)
    store = streams.group_table.data
    store.data["k"] = b"v"
    store._key_partition["k"] = 3
    assert wipe_store(store, {3}) == 1
    assert not store.data and not store._key_partition


def test_an_unknown_store_is_an_error_not_a_silent_no_op() -> None:
    class OtherStore:
        data = {"k": b"v"}

    with pytest.raises(TypeError, match="streams.store must be memory or rocksdb"):
        wipe_store(OtherStore(), {0})
