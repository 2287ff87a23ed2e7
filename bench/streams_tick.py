"""Streams tick cost: which groups of a partition are due, by walking the ``groups`` table (the baseline) and from the
deadline index (``rlstream/streams/deadlines.py``), over the same table of closed groups, in one run.

Closed groups stay ``streams.closed_retention_s`` (an hour) so that late duplicates are recognised: 100,000 of them
is about 28 groups a second for an hour. The index is built once per rebalance or recovery (timed), then a tick pops
only what is due.

    .venv/bin/python bench/streams_tick.py [--groups 10000 100000] [--partitions 4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlstream.schemas.codec import AvroCodec  # noqa: E402
from rlstream.streams.assembly import AssemblyRules, GroupAssembler  # noqa: E402
from rlstream.streams.deadlines import DueIndex  # noqa: E402


def closed_groups(n: int, partitions: int, closed_at: float) -> dict[str, Any]:
    return {f"g{i}": {"g": f"g{i}", "p": i % partitions, "closed": True, "closed_at": closed_at,
                      "ids": ["t0", "t1", "t2", "t3"]} for i in range(n)}


def per_tick_s(assembler: GroupAssembler, now: float, ticks: int) -> float:
    samples = []
    for k in range(ticks):
        start = time.perf_counter()
        assembler.due(0, now + k * 1e-3)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--ticks", type=int, default=21)
    args = ap.parse_args()
    rules, codec, now = AssemblyRules(group_timeout_s=300.0, min_group_size=2), AvroCodec(), time.time()
    print(f"{'closed groups':>14} {'walk ms/tick':>13} {'index ms/tick':>14} {'ratio':>9} {'index build ms':>15}")
    for n in args.groups:
        groups = closed_groups(n, args.partitions, now - 10.0)  # none due: the common tick
        walk = per_tick_s(GroupAssembler(groups, {}, codec, rules), now, args.ticks)
        indexed = GroupAssembler(groups, {}, codec, rules, DueIndex())
        start = time.perf_counter()
        indexed.due(0, now)  # builds partition 0's heap
        build = time.perf_counter() - start
        index = per_tick_s(indexed, now, args.ticks)
        print(f"{n:>14,} {walk * 1e3:>13.2f} {index * 1e3:>14.4f} {index / walk:>8.5f}x {build * 1e3:>15.1f}")
    print("(per partition; a worker ticks each of its partitions every streams.tick_interval_s)")


if __name__ == "__main__":
    main()
