"""A plain aiokafka read_committed consumer without rlstream's guard (rlstream/transport/aborted_index.py), run as a
process of its own because the guard patches aiokafka for the whole process that installs it.

``python tests/support/unguarded_reader.py BOOTSTRAP TOPIC PARTITION START`` prints, as JSON, the offsets of the records it
is handed from START up to the partition's end offset. Tests call :func:`unguarded_offsets`.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition


async def read_offsets(bootstrap: str, topic: str, partition: int, start: int) -> list[int]:
    """The offsets a plain read_committed consumer placed at ``start`` is handed, up to the end offset."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, start)
        end = (await consumer.end_offsets([tp]))[tp]
        offsets: list[int] = []
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=500)
            offsets += [record.offset for record in batch.get(tp, [])]
        return offsets
    finally:
        await consumer.stop()


def unguarded_offsets(bootstrap: str, topic: str, partition: int, start: int, timeout_s: float = 60.0) -> list[int]:
    """:func:`read_offsets` in a fresh interpreter that never imports rlstream."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), bootstrap, topic, str(partition),
                           str(start)], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return [int(offset) for offset in json.loads(done.stdout.strip().splitlines()[-1])]


if __name__ == "__main__":
    found = asyncio.run(read_offsets(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    assert not any(name.startswith("rlstream") for name in sys.modules), "the guard must not be installed here"
    print(json.dumps(found))
