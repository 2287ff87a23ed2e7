"""The capture gateway's on-disk spool: append-only, fsync'd segment files of checksummed records.

While Kafka is slow or down the gateway writes its events here; a drainer re-sends them in order once Kafka
answers, and a restarted gateway finds them again. Layout of a spool directory:

The directory is 0700 and its files 0600 (they hold conversations).

With ``tenant_max_bytes``, each tenant's records not yet acknowledged may take at most that many bytes (a record
names its tenant in :attr:`SpoolRecord.tenant`): one tenant's flood fills its own share and the rest of the spool
stays for the others. Records a previous gateway left are counted in the whole (``max_bytes``), in no tenant's share.

* ``.lock``: an exclusive ``flock`` held while a gateway uses the spool (two gateways never share one);
* ``<seq>.seg`` (``seq``: 20 digits): segment files, written by one gateway in order; a gateway never appends to a
  segment it did not create (after a restart the old ones are only read);
* ``<seq>.ack``: the acknowledged records of that segment (JSON ``{"offset": O, "acked": [...]}``: every record
  starting before byte ``O`` and every record starting at one of the listed offsets was acknowledged by Kafka),
  replaced atomically after each drained batch. A sealed segment whose every record is acknowledged is deleted
  with its ``.ack`` file.

A segment is the 8-byte header ``RLSPOOL1`` followed by records. A record is ``RSP1`` (4 bytes), the payload length
(u32, big endian), the CRC-32 of length and payload (u32), then the payload: topic length (u16), topic (UTF-8), key
length (u32), key, value (the event exactly as it goes to Kafka: Avro, encoded once by the publisher's codec).
A record cut short by a crash, or damaged, fails its length or checksum: it is skipped with a warning (the
reader resynchronises on the next ``RSP1`` whose checksum holds) and never stops the gateway.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import threading
import zlib
from array import array
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

from rlstream.transport.log import get_logger

log = get_logger(__name__)

SEGMENT_HEADER = b"RLSPOOL1"
RECORD_MAGIC = b"RSP1"
_FRAME = struct.Struct(">4sII")  # magic, payload length, crc32(length + payload)
_TOPIC_LEN = struct.Struct(">H")
_KEY_LEN = struct.Struct(">I")
#: Larger payloads are taken for a damaged length field (Kafka's own limit is far below).
MAX_RECORD_BYTES = 256 * 1024 * 1024
SEGMENT_SUFFIX, ACK_SUFFIX = ".seg", ".ack"
#: The spool holds conversations: only the gateway's user may read it.
DIRECTORY_MODE, FILE_MODE = 0o700, 0o600


class SpoolError(RuntimeError):
    """The spool directory cannot be used (locked by another gateway, not writable)."""


@dataclass(frozen=True)
class SpoolRecord:
    """One event as it goes to Kafka."""

    topic: str
    key: bytes
    value: bytes
    #: whose record it is (bounded by the spool's ``tenant_max_bytes``); not written to disk; None: no tenant's
    tenant: str | None = field(default=None, compare=False)


@dataclass(frozen=True, order=True)
class Position:
    """Where a record lies: its segment and the byte offset where its frame starts."""

    segment: int
    offset: int


@dataclass(frozen=True)
class StoredRecord:
    position: Position
    record: SpoolRecord


def encode_record(record: SpoolRecord) -> bytes:
    """The framed bytes of one record (magic, length, checksum, payload)."""
    topic = record.topic.encode()
    payload = b"".join((_TOPIC_LEN.pack(len(topic)), topic, _KEY_LEN.pack(len(record.key)), record.key,
                        record.value))
    length = struct.pack(">I", len(payload))
    return _FRAME.pack(RECORD_MAGIC, len(payload), zlib.crc32(length + payload)) + payload


def decode_payload(payload: bytes) -> SpoolRecord:
    """The record inside a payload whose checksum held; ValueError when its inner lengths do not add up."""
    (topic_len,) = _TOPIC_LEN.unpack_from(payload, 0)
    pos = _TOPIC_LEN.size
    topic = payload[pos: pos + topic_len].decode()
    pos += topic_len
    if pos + _KEY_LEN.size > len(payload):
        raise ValueError("payload shorter than its topic and key lengths")
    (key_len,) = _KEY_LEN.unpack_from(payload, pos)
    pos += _KEY_LEN.size
    if pos + key_len > len(payload):
        raise ValueError("payload shorter than its key length")
    return SpoolRecord(topic, payload[pos: pos + key_len], payload[pos + key_len:])


def read_frame(data: bytes, pos: int) -> tuple[SpoolRecord | None, int, str]:
    """The record framed at ``data[pos:]``: ``(record, end, "")``, or ``(None, pos, reason)`` when the bytes there
    are not a whole, intact record (reason ``truncated``: they end before the record does; else ``corrupt``)."""
    if len(data) - pos < _FRAME.size:
        return None, pos, "truncated"
    magic, length, crc = _FRAME.unpack_from(data, pos)
    if magic != RECORD_MAGIC or length > MAX_RECORD_BYTES:
        return None, pos, "corrupt"
    end = pos + _FRAME.size + length
    if end > len(data):
        return None, pos, "truncated"
    payload = data[pos + _FRAME.size: end]
    if zlib.crc32(struct.pack(">I", length) + payload) != crc:
        return None, pos, "corrupt"
    try:
        return decode_payload(payload), end, ""
    except (ValueError, UnicodeDecodeError, struct.error):
        return None, pos, "corrupt"


@dataclass
class ScanResult:
    """The intact records of a segment's bytes, and what was skipped."""

    spans: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each intact record
    skipped: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, reason) of skipped bytes


def scan(data: bytes, start: int = len(SEGMENT_HEADER)) -> ScanResult:
    """Every intact record from ``start``; damaged bytes are skipped up to the next record whose checksum holds,
    bytes that end before their record does (a write cut short) are skipped to the end."""
    out = ScanResult()
    pos = start
    while pos < len(data):
        record, end, reason = read_frame(data, pos)
        if record is not None:
            out.spans.append((pos, end))
            pos = end
            continue
        nxt = data.find(RECORD_MAGIC, pos + 1)
        while nxt >= 0 and read_frame(data, nxt)[0] is None:
            nxt = data.find(RECORD_MAGIC, nxt + 1)
        if nxt < 0:
            out.skipped.append((pos, len(data), reason))
            break
        out.skipped.append((pos, nxt, "corrupt"))
        pos = nxt
    return out


@dataclass
class SpoolStats:
    written: int = 0            # records written and fsync'd
    dropped_full: int = 0       # not written: the spool was at spool_max_bytes
    dropped_tenant: int = 0     # not written: its tenant's records not yet acknowledged were at tenant_max_bytes
    dropped_error: int = 0      # not written: the disk failed (full, read-only, I/O error)
    acknowledged: int = 0       # records Kafka acknowledged
    skipped_damaged: int = 0    # damaged or cut-short records skipped when reading


@dataclass
class _Segment:
    seq: int
    path: Path
    starts: array = field(default_factory=lambda: array("q"))  # frame start of each record, ascending
    ends: array = field(default_factory=lambda: array("q"))
    size: int = 0                       # bytes of the file (written and fsync'd)
    upto: int = 0                       # records [0, upto) are acknowledged
    acked: set[int] = field(default_factory=set)  # starts of acknowledged records at index >= upto
    owners: dict[int, tuple[str, int]] = field(default_factory=dict)  # start -> (tenant, bytes) until acknowledged
    sealed: bool = True
    fd: int | None = None               # the segment being written
    dirty: bool = False                 # acknowledgements not yet in the .ack file

    @property
    def pending(self) -> int:
        return len(self.starts) - self.upto - len(self.acked)

    @property
    def ack_path(self) -> Path:
        return self.path.with_suffix(ACK_SUFFIX)

    def ack_offset(self) -> int:
        return self.ends[self.upto - 1] if self.upto else len(SEGMENT_HEADER)

    def is_acked(self, index: int) -> bool:
        return index < self.upto or self.starts[index] in self.acked

    def advance(self) -> None:
        while self.upto < len(self.starts) and self.starts[self.upto] in self.acked:
            self.acked.discard(self.starts[self.upto])
            self.upto += 1



class Spool:
    """A directory of segment files. Thread-safe: the gateway writes and reads in worker threads (``append``,
    ``unacknowledged``, ``commit``) while its event loop records acknowledgements; the loop's calls
    (``mark_acknowledged``, ``pending``) only take a lock that no disk operation holds."""

    def __init__(self, directory: Path, max_bytes: int, segment_bytes: int = 16 * 1024 * 1024,
                 tenant_max_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.tenant_max_bytes = tenant_max_bytes if tenant_max_bytes is not None else max_bytes
        self._tenant_bytes: dict[str, int] = {}  # per tenant: bytes of its records not yet acknowledged
        self.segment_bytes = segment_bytes
        self.stats = SpoolStats()
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None  # only the writer (under _write_lock) touches its fd
        self._lock = threading.Lock()          # the index: segments, offsets, acknowledgements, stats
        self._write_lock = threading.Lock()    # one writer at a time (appends, rolls)
        self._commit_lock = threading.Lock()   # one commit at a time (acknowledgement files)
        self._lock_fd: int | None = None
        self._next_seq = 1  # segment numbers only grow: a new segment sorts after every older one
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: Path, max_bytes: int, segment_bytes: int = 16 * 1024 * 1024,
             tenant_max_bytes: int | None = None) -> "Spool":
        """Lock ``directory`` (created if missing) and read what a previous gateway left there."""
        spool = cls(directory, max_bytes, segment_bytes, tenant_max_bytes)
        spool._open()
        return spool

    def _open(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=DIRECTORY_MODE)
            os.chmod(self.directory, DIRECTORY_MODE)  # it holds conversations: the gateway's user only
            self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
        except OSError as exc:
            raise SpoolError(f"spool directory {self.directory} is not usable: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise SpoolError(f"spool directory {self.directory} is in use by another gateway") from exc
        for path in sorted(self.directory.glob("*" + SEGMENT_SUFFIX)):
            if not path.stem.isdigit():
                log.warning("not a spool segment; left alone", path=str(path))
                continue
            with contextlib.suppress(OSError):  # a spool written with wider permissions is narrowed
                os.chmod(path, FILE_MODE)
            self._load(int(path.stem), path)
            self._next_seq = max(self._next_seq, int(path.stem) + 1)
        for path in self.directory.glob("*" + ACK_SUFFIX):  # acknowledgements of segments already deleted
            if path.stem.isdigit() and int(path.stem) not in self._segments:
                path.unlink(missing_ok=True)
        if self._segments:
            log.warning("spool holds events from before; they are sent first", directory=str(self.directory),
                        pending=self.pending, segments=len(self._segments), bytes=self.disk_bytes)

    def _load(self, seq: int, path: Path) -> None:
        data = path.read_bytes()
        seg = _Segment(seq, path, size=len(data))
        start = len(SEGMENT_HEADER)
        if not data.startswith(SEGMENT_HEADER):
            if len(data) >= len(SEGMENT_HEADER):
                log.warning("spool segment header damaged; reading its records anyway", path=str(path))
            start = 0
        result = scan(data, start)
        for s, e in result.spans:
            seg.starts.append(s)
            seg.ends.append(e)
        for s, e, reason in result.skipped:
            self.stats.skipped_damaged += 1
            log.warning("spool: damaged bytes skipped" if reason == "corrupt" else
                        "spool: record cut short (crash while writing?) skipped", path=str(path), offset=s,
                        bytes=e - s)
        try:
            acks = json.loads(seg.ack_path.read_text())
            offset, acked = int(acks["offset"]), {int(a) for a in acks.get("acked", [])}
        except FileNotFoundError:
            offset, acked = 0, set()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("spool: acknowledgement file unreadable; its records are sent again", path=str(seg.ack_path),
                        error=str(exc))
            offset, acked = 0, set()
        seg.upto = bisect_left(seg.starts, offset)
        later = set(seg.starts[seg.upto:])
        seg.acked = acked & later
        seg.advance()
        if seg.pending == 0:
            self._unlink(seg)
        else:
            self._segments[seq] = seg

    def close(self) -> None:
        """Seal the segment being written, persist the acknowledgements, release the directory."""
        with self._write_lock:
            if self._closed:
                return
            self._seal()
            self._closed = True
        self.commit()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- figures -------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Records written and not yet acknowledged."""
        with self._lock:
            return sum(seg.pending for seg in self._segments.values())

    @property
    def disk_bytes(self) -> int:
        with self._lock:
            return sum(seg.size for seg in self._segments.values())

    @property
    def segments(self) -> int:
        with self._lock:
            return len(self._segments)

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes of ``tenant``'s records written and not yet acknowledged."""
        with self._lock:
            return self._tenant_bytes.get(tenant, 0)

    def tenant_full(self, tenant: str) -> bool:
        """True when ``tenant``'s share (``tenant_max_bytes``) is used up: its next record would be dropped."""
        return self.tenant_bytes(tenant) >= self.tenant_max_bytes

    # -- writing -------------------------------------------------------------------------------
    def append(self, records: list[SpoolRecord]) -> list[Position | None]:
        """Write ``records`` and fsync them (one write and one fsync per segment touched); the position of each,
        or None for one not kept (the spool at ``max_bytes``, its tenant at ``tenant_max_bytes``, or the disk failed:
        counted and logged). Never raises."""
        out: list[Position | None] = [None] * len(records)
        with self._write_lock:
            if self._closed:
                with self._lock:
                    self.stats.dropped_error += len(records)
                return out
            batch: list[tuple[int, bytes]] = []  # (index in out, frame) for the active segment
            batch_bytes = 0
            used = self.disk_bytes
            with self._lock:
                tenant_used = dict(self._tenant_bytes)  # plus this call's records, as they are taken
            for index, record in enumerate(records):
                frame = encode_record(record)
                if used + batch_bytes + len(frame) > self.max_bytes:
                    with self._lock:
                        self.stats.dropped_full += 1
                    continue
                if record.tenant is not None:
                    if tenant_used.get(record.tenant, 0) + len(frame) > self.tenant_max_bytes:
                        with self._lock:
                            self.stats.dropped_tenant += 1
                        continue
                    tenant_used[record.tenant] = tenant_used.get(record.tenant, 0) + len(frame)
                active = self._active
                if active is None or (active.size + batch_bytes + len(frame) > self.segment_bytes
                                      and (batch or len(active.starts))):
                    if batch:
                        self._flush(batch, out, records)
                        batch, batch_bytes = [], 0
                    self._roll()
                    used = self.disk_bytes
                    if self._active is None:
                        with self._lock:
                            self.stats.dropped_error += 1
                        continue
                batch.append((index, frame))
                batch_bytes += len(frame)
            if batch:
                self._flush(batch, out, records)
        return out

    def _flush(self, batch: list[tuple[int, bytes]], out: list[Position | None],
               records: list[SpoolRecord]) -> None:
        seg = self._active
        assert seg is not None and seg.fd is not None
        data = b"".join(frame for _, frame in batch)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(seg.fd, view):]
            os.fsync(seg.fd)
        except OSError as exc:
            with self._lock:
                self.stats.dropped_error += len(batch)
            log.error("spool write failed: events dropped", path=str(seg.path), count=len(batch), error=str(exc))
            try:  # take the partial write back; if that fails too, the checksums skip it when the segment is read
                os.ftruncate(seg.fd, seg.size)
            except OSError:
                pass
            self._seal()  # the next write starts a fresh segment
            return
        with self._lock:
            pos = seg.size
            for index, frame in batch:
                seg.starts.append(pos)
                seg.ends.append(pos + len(frame))
                out[index] = Position(seg.seq, pos)
                tenant = records[index].tenant
                if tenant is not None:
                    seg.owners[pos] = (tenant, len(frame))
                    self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + len(frame)
                pos += len(frame)
            seg.size = pos
            self.stats.written += len(batch)

    def _roll(self) -> None:
        self._seal()
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        path = self.directory / f"{seq:020d}{SEGMENT_SUFFIX}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, FILE_MODE)
        except OSError as exc:
            log.error("spool segment not created", path=str(path), error=str(exc))
            return
        try:
            os.write(fd, SEGMENT_HEADER)
            os.fsync(fd)
            self._fsync_dir()
        except OSError as exc:
            log.error("spool segment not created", path=str(path), error=str(exc))
            os.close(fd)
            path.unlink(missing_ok=True)
            return
        seg = _Segment(seq, path, size=len(SEGMENT_HEADER), sealed=False, fd=fd)
        with self._lock:
            self._segments[seq] = seg
        self._active = seg

    def _seal(self) -> None:
        seg, self._active = self._active, None
        if seg is None:
            return
        if seg.fd is not None:
            os.close(seg.fd)
            seg.fd = None
        with self._lock:
            seg.sealed = True
            done = seg.pending == 0
            if done:
                self._segments.pop(seg.seq, None)
        if done:
            self._unlink(seg)

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- reading and acknowledging ----------------------------------------------------------------
    def unacknowledged(self, limit: int, max_bytes: int = 64 * 1024 * 1024) -> list[StoredRecord]:
        """Up to ``limit`` records not yet acknowledged, oldest first. A record whose checksum fails now (the disk
        changed it) is skipped with a warning and counted as acknowledged."""
        wanted: list[tuple[int, Path, list[tuple[int, int]]]] = []
        with self._lock:  # the spans to read, oldest first, no more than asked for
            count = 0
            for seq in sorted(self._segments):
                seg = self._segments[seq]
                spans: list[tuple[int, int]] = []
                for i in range(seg.upto, len(seg.starts)):
                    if count >= limit:
                        break
                    if not seg.is_acked(i):
                        spans.append((seg.starts[i], seg.ends[i]))
                        count += 1
                wanted.append((seq, seg.path, spans))
                if count >= limit:
                    break
        out: list[StoredRecord] = []
        size = 0
        for seq, path, spans in wanted:
            if not spans:
                continue
            try:
                fh = open(path, "rb")
            except FileNotFoundError:
                continue
            with fh:
                for start, end in spans:
                    fh.seek(start)
                    record, _, _ = read_frame(fh.read(end - start), 0)
                    if record is None:
                        log.warning("spool: record damaged on disk; skipped", path=str(path), offset=start)
                        with self._lock:
                            self.stats.skipped_damaged += 1
                            seg = self._segments.get(seq)
                            if seg is not None:
                                self._ack(seg, start)
                        continue
                    out.append(StoredRecord(Position(seq, start), record))
                    size += end - start
                    if len(out) >= limit or size >= max_bytes:
                        return out
        return out

    def mark_acknowledged(self, position: Position) -> None:
        """Kafka acknowledged the record at ``position`` (on disk after the next :meth:`commit`)."""
        with self._lock:
            seg = self._segments.get(position.segment)
            if seg is not None and self._ack(seg, position.offset):
                self.stats.acknowledged += 1

    def _ack(self, seg: _Segment, start: int) -> bool:
        """Record one acknowledgement (under ``_lock``); its tenant's share is freed."""
        index = bisect_left(seg.starts, start)
        if index >= len(seg.starts) or seg.starts[index] != start or seg.is_acked(index):
            return False
        owner = seg.owners.pop(start, None)
        if owner is not None:
            left = self._tenant_bytes.get(owner[0], 0) - owner[1]
            if left > 0:
                self._tenant_bytes[owner[0]] = left
            else:
                self._tenant_bytes.pop(owner[0], None)
        seg.acked.add(start)
        seg.advance()
        seg.dirty = True
        return True

    def commit(self) -> None:
        """Persist the acknowledgements (``.ack`` files, replaced atomically and fsync'd); delete sealed segments
        whose every record is acknowledged."""
        with self._commit_lock:
            self._commit()

    def _commit(self) -> None:
        with self._lock:
            done = [seg for seg in self._segments.values() if seg.dirty and seg.sealed and seg.pending == 0]
            for seg in done:
                self._segments.pop(seg.seq)
            writes = [(seg, json.dumps({"offset": seg.ack_offset(), "acked": sorted(seg.acked)}).encode())
                      for seg in self._segments.values() if seg.dirty]
            for seg, _ in writes:
                seg.dirty = False
        for seg in done:
            self._unlink(seg)
        for seg, body in writes:
            tmp = seg.ack_path.with_suffix(".ack-tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
                try:
                    os.write(fd, body)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, seg.ack_path)
            except OSError as exc:  # the records stay unacknowledged on disk: sent again after a restart
                log.error("spool acknowledgements not written", path=str(seg.ack_path), error=str(exc))
                with self._lock:
                    seg.dirty = True

    @staticmethod
    def _unlink(seg: _Segment) -> None:
        try:
            seg.path.unlink(missing_ok=True)
            seg.ack_path.unlink(missing_ok=True)
        except OSError as exc:
            log.error("spool segment not deleted; its records may be sent again", path=str(seg.path), error=str(exc))
