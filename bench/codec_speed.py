"""Codec speed: rlstream's AvroCodec against bare fastavro on the same realistic event, in one run.

The event is a TrajectoryEvent of 8 turns x 512 completion tokens with logprobs (and 256 prompt tokens per
turn), about 44 KiB encoded, built as ``bench/streams_throughput.py`` builds its events. Each line prints the
time per call (best of several samples, or their median) of our codec and of fastavro alone
(``schemaless_writer``/``schemaless_reader`` with a parsed schema), sampled alternately, and their ratio.
Decoding uses a second codec (sharing the registry with --registry), as a consumer process would; with
--registry the registry's copy of the schema has no docs (same version, other JSON text):

    .venv/bin/python bench/codec_speed.py [--number 10] [--repeat 31] [--stat min|median] [--registry]
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastavro  # noqa: E402

from rlstream.schemas.codec import AvroCodec, schema_json  # noqa: E402
from rlstream.schemas.models import TrajectoryEvent  # noqa: E402
from bench.workload import make_trajectory  # noqa: E402

NAME = TrajectoryEvent.avro_name


class DictRegistry:
    """An in-process schema registry (ids in registration order), for the Confluent framing."""

    def __init__(self) -> None:
        self.schemas: list[str] = []

    def register(self, subject: str, schema_json: str) -> int:
        if schema_json not in self.schemas:
            self.schemas.append(schema_json)
        return self.schemas.index(schema_json) + 1

    def get_schema(self, schema_id: int) -> str:
        return self.schemas[schema_id - 1]


class DoclessRegistry(DictRegistry):
    """Answers with the registered schema re-serialized without its docs: the same version (same fingerprint)
    in other JSON text, as a registry copy registered by another producer can be."""

    def get_schema(self, schema_id: int) -> str:
        return json.dumps(without_docs(json.loads(super().get_schema(schema_id))))


def without_docs(node: Any) -> Any:
    if isinstance(node, list):
        return [without_docs(n) for n in node]
    if isinstance(node, dict):
        return {k: without_docs(v) for k, v in node.items() if k != "doc"}
    return node


def per_call_ms(fn: Callable[[], Any], number: int) -> float:
    """Milliseconds per call of ``fn`` over ``number`` calls, garbage collection off (as timeit does)."""
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - start) / number * 1e3
    finally:
        if gc_was_on:
            gc.enable()


def compare(ours: Callable[[], Any], bare: Callable[[], Any], number: int, repeat: int,
            stat: Callable[[list[float]], float]) -> tuple[float, float]:
    """``stat`` of the ms per call of ``ours`` and of ``bare`` over ``repeat`` samples, taken alternately so that
    both see the same machine load."""
    ours(), bare()  # warm up
    a, b = [], []
    for _ in range(repeat):
        a.append(per_call_ms(ours, number))
        b.append(per_call_ms(bare, number))
    return stat(a), stat(b)


def evolved_reader_schema() -> dict[str, Any]:
    """TrajectoryEvent with one more field (with a default): a newer reader, so reading needs resolution."""
    schema = json.loads(schema_json(NAME))
    schema["fields"].append({"name": "bench_extra", "type": "string", "default": ""})
    return schema


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--number", type=int, default=10, help="calls per sample")
    ap.add_argument("--repeat", type=int, default=31, help="samples per measurement")
    ap.add_argument("--stat", choices=["min", "median"], default="min",
                    help="which sample to print: the best (least disturbed by other processes) or the median")
    ap.add_argument("--registry", action="store_true",
                    help="Confluent wire format with an in-process registry (whose copy of a schema has no docs)")
    args = ap.parse_args()

    event = make_trajectory(turns=8, completion_tokens=512, prompt_tokens=256, seed=1)
    record = event.model_dump()
    codec = AvroCodec(registry=DoclessRegistry()) if args.registry else AvroCodec()
    data = codec.encode(event)
    header = 5 if args.registry else 10
    parsed = fastavro.parse_schema(json.loads(schema_json(NAME)))
    body = data[header:]

    def bare_encode() -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, record)
        return out.getvalue()

    def bare_decode() -> Any:
        return fastavro.schemaless_reader(io.BytesIO(body), parsed, None)

    assert bare_encode() == body, "our body and fastavro's differ"
    reader = AvroCodec(registry=codec.registry)  # a consumer is another process: its own codec
    newer = AvroCodec(registry=codec.registry)
    newer.add_schema(evolved_reader_schema(), reader=True)
    parsed_newer = fastavro.parse_schema(evolved_reader_schema())

    rows = [
        ("encode_record (dict)", lambda: codec.encode_record(record, NAME), bare_encode),
        ("decode_record (dict)", lambda: reader.decode_record(data, NAME), bare_decode),
        ("encode (model)", lambda: codec.encode(event), bare_encode),
        ("decode (model)", lambda: reader.decode(data, TrajectoryEvent), bare_decode),
        ("decode, newer reader", lambda: newer.decode_record(data, NAME),
         lambda: fastavro.schemaless_reader(io.BytesIO(body), parsed, parsed_newer)),
        # what the streams worker does: token ids and logprobs counted, not built (rlstream/schemas/skim.py)
        ("skim_record (streams)", lambda: reader.skim_record(data, NAME), bare_decode),
    ]
    framing = "Confluent wire format" if args.registry else "single-object encoding"
    print(f"event: TrajectoryEvent, 8 turns x 512 completion tokens + logprobs, {len(data) / 1024:.1f} KiB "
          f"({framing}); {args.stat} of {args.repeat} samples of {args.number} calls")
    print(f"{'':22} {'rlstream ms':>12} {'fastavro ms':>12} {'ratio':>7}")
    for label, ours, bare in rows:
        a, b = compare(ours, bare, args.number, args.repeat, min if args.stat == "min" else statistics.median)
        print(f"{label:22} {a:12.3f} {b:12.3f} {a / b:6.2f}x")
    print("(model rows include pydantic model_dump/model_validate, which bare fastavro does not do)")


if __name__ == "__main__":
    main()
