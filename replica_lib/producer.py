"""The producer library for primary services: change events in the native envelope, written to Kafka.

Every write is idempotent (``enable.idempotence``, ``acks=all``, at most 5 in flight, so no duplicates and no
reordering on retry) and keyed by the row's key columns, so one entity always lands in one partition
(``murmur2_random``: the same partition the Java client picks). Every acknowledged write yields its exact
:class:`Position`, also one that librdkafka acknowledges without its offset (the library reads the partition back
to find it); a failed delivery raises :class:`ProducerError` (from :meth:`Delivery.result`, and in any case from
:meth:`ChangeProducer.flush`/:meth:`ChangeProducer.close`): failures never vanish.

A transactional producer (``transactional_id=...``) makes a group of writes across partitions and topics
visible atomically to ``read_committed`` consumers::

    with producer.transaction():
        producer.upsert("orders", {"order_id": 1}, {...}, seq=7)
        producer.delete("payments", {"payment_id": 9}, seq=3)
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from replica_lib.errors import LateChangeError, ProducerError

logger = logging.getLogger(__name__)

Op = Literal["upsert", "delete"]
OPS: tuple[Op, ...] = ("upsert", "delete")
COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
LOWER_SEQ_CHOICES = ("refuse", "warn", "allow")
#: librdkafka properties (and their aliases) that replica sets itself: the safety guarantees, the key ->
#: partition mapping, transactions (``transactional_id``), and never auto-creating a topic with defaults.
FIXED_PROPERTIES = frozenset(
    {
        "enable.idempotence",
        "acks",
        "request.required.acks",
        "max.in.flight.requests.per.connection",
        "max.in.flight",
        "partitioner",
        "transactional.id",
        "allow.auto.create.topics",
    }
)


# ---------------------------------------------------------------------------------------------- the contract
@dataclass(frozen=True)
class Change:
    """One change of one keyed row (docs/design.md §3).

    ``tombstone=True`` writes a Kafka tombstone (null value) instead of an ``op: delete`` envelope: it carries no
    ``seq``, so producers that use ``seq`` send ``op: delete`` with a ``seq`` (and may add a tombstone after it,
    for compaction).
    """

    key: Mapping[str, Any]
    op: Op = "upsert"
    data: Mapping[str, Any] | None = None
    seq: int | None = None
    ts_ms: int | None = None
    table: str | None = None
    tombstone: bool = False

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("a change needs at least one key column")
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.op == "upsert":
            if self.data is None:
                raise ValueError("an upsert carries the full row in data")
            if self.tombstone:
                raise ValueError("a tombstone is a delete")
            missing = [k for k in self.key if k not in self.data]
            if missing:
                raise ValueError(f"data must include the key columns, missing {missing}")
        elif self.data is not None:
            raise ValueError("a delete carries no data")
        for name in ("seq", "ts_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.tombstone and (self.seq is not None or self.ts_ms is not None or self.table is not None):
            raise ValueError("a tombstone has no value, so it cannot carry seq, ts_ms or table")


def encode_key(key: Mapping[str, Any]) -> bytes:
    """The Kafka key: the UTF-8 JSON object of the key columns, canonical (sorted, compact, unescaped).

    Partitioning and compaction compare key bytes, so one entity must always encode to the same bytes, also
    when another producer (e.g. a JVM one) writes the same key: text is UTF-8, never ``\\u``-escaped.
    """
    text = json.dumps(dict(key), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return text.encode()


def encode_value(change: Change) -> bytes | None:
    """The Kafka value: the JSON envelope, or ``None`` (a tombstone)."""
    if change.tombstone:
        return None
    envelope: dict[str, Any] = {"op": change.op}
    if change.seq is not None:
        envelope["seq"] = change.seq
    if change.ts_ms is not None:
        envelope["ts_ms"] = change.ts_ms
    if change.table is not None:
        envelope["table"] = change.table
    envelope["data"] = dict(change.data) if change.data is not None else None
    return json.dumps(envelope, separators=(",", ":"), ensure_ascii=False, default=str).encode()


# ---------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ProducerSettings:
    """Batching and reliability knobs; the defaults favour throughput without giving up safety."""

    linger_ms: int = 5
    batch_size: int = 256 * 1024
    compression: str = "lz4"
    delivery_timeout_ms: int = 120_000
    connect_timeout_s: float = 15.0
    transactional_id: str | None = None
    transaction_timeout_ms: int = 60_000
    #: A change whose ``seq`` is lower than one this producer already wrote for the key: ``refuse`` raises
    #: :class:`LateChangeError` before anything is written, ``warn`` logs it and writes it, ``allow`` writes it.
    #: Such a change loses to the higher one in every replica, but Kafka's compaction keeps the *last* record of
    #: a key in log order, so a rebuild from a compacted topic would keep it instead.
    on_lower_seq: str = "refuse"
    #: Keys whose last seq is remembered for that check (the least recently written are forgotten first).
    seq_keys_tracked: int = 1_000_000
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        for name in ("linger_ms", "batch_size", "delivery_timeout_ms", "transaction_timeout_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        delivery_ms = self.delivery_timeout_ms
        if self.transactional_id:
            delivery_ms = min(delivery_ms, self.transaction_timeout_ms)
        if self.linger_ms >= delivery_ms:
            raise ValueError(f"linger_ms must be below the delivery timeout ({delivery_ms} ms)")
        if self.connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be positive")
        if self.on_lower_seq not in LOWER_SEQ_CHOICES:
            raise ValueError(f"on_lower_seq must be one of {LOWER_SEQ_CHOICES}, got {self.on_lower_seq!r}")
        if self.seq_keys_tracked < 0:
            raise ValueError("seq_keys_tracked must not be negative")
        for key, _ in self.extra:
            if key in FIXED_PROPERTIES:
                raise ValueError(f"{key} is fixed by replica for safety and cannot be overridden")

    def client_config(self, connection: Mapping[str, str]) -> dict[str, Any]:
        """The full librdkafka configuration for ``connection`` (bootstrap servers, security options)."""
        conf: dict[str, Any] = {
            **connection,
            "linger.ms": self.linger_ms,
            "batch.size": self.batch_size,
            "compression.type": self.compression,
            "delivery.timeout.ms": self.delivery_timeout_ms,
            **dict(self.extra),
            "enable.idempotence": True,
            "acks": "all",
            "max.in.flight.requests.per.connection": 5,
            "partitioner": "murmur2_random",
            "allow.auto.create.topics": False,  # a producer's default is True: it would create unsafe topics
        }
        if self.transactional_id:
            conf["transactional.id"] = self.transactional_id
            conf["transaction.timeout.ms"] = self.transaction_timeout_ms
            # librdkafka refuses a delivery timeout longer than the transaction timeout.
            conf["delivery.timeout.ms"] = min(self.delivery_timeout_ms, self.transaction_timeout_ms)
        return conf


# ---------------------------------------------------------------------------------------------- producing
@dataclass(frozen=True)
class Position:
    """Where an acknowledged change sits in the log."""

    topic: str
    partition: int
    offset: int


#: A record as the log holds it, for finding it again: key, value, headers.
_Record = tuple[bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]


def _record_of(msg: Any) -> _Record:
    return msg.key(), msg.value(), tuple((k, bytes(v or b"")) for k, v in (msg.headers() or ()))


@dataclass
class _Gap:
    """Acknowledged writes to one partition whose offsets librdkafka did not report.

    An idempotent producer whose request timed out retries it; if a later request to the partition succeeds first,
    librdkafka acknowledges the earlier writes "implicitly", without offsets (and likewise when a retry hits the
    broker's duplicate check). Written, they sit in send order after ``after`` (this producer's last known offset
    in the partition) and before ``before`` (its next known one, or the high watermark when none came yet): reading
    that range back finds them. Read from the end, each is placed at the latest offset consistent with the log, which
    is its own unless another record with the same key, value and headers lies between.

    librdkafka acknowledges a refused request implicitly too, and never sends it again, when the partition took the
    later one because it held no state of this producer yet (a new topic's partition before its leader was ready:
    ``TopicAdmin.ensure`` waits for them). Such writes are not in the range, and :meth:`Delivery.result` says so.
    """

    topic: str
    partition: int
    after: int | None
    before: int | None = None
    members: list[tuple[Delivery, _Record]] = field(default_factory=list)
    placed: bool = False


class Delivery:
    """The outcome of one send: :meth:`result` gives its :class:`Position` or raises :class:`ProducerError`."""

    def __init__(self, producer: ChangeProducer, topic: str) -> None:
        self._producer = producer
        self.topic = topic
        self._done = threading.Event()
        self._position: Position | None = None
        self._error: str | None = None
        self._gap: _Gap | None = None
        self._unplaced: str | None = None  # where an offset not reported was looked for in vain

    def _complete(self, position: Position | None, error: str | None) -> None:
        self._position, self._error = position, error
        self._done.set()

    def _complete_in(self, gap: _Gap) -> None:
        self._gap = gap
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float = 30.0) -> Position:
        """Wait for the broker's acknowledgement and return the position (other sends' failures aside)."""
        self._producer._serve_until(self._done, timeout_s)
        if self._gap is not None and not self._gap.placed:
            self._producer._place(self._gap, timeout_s)
        if self._unplaced is not None:
            raise ProducerError(
                f"write to {self.topic} was acknowledged without its offset, and not found in {self._unplaced}",
                topic=self.topic,
            )
        if self._error is not None:
            raise ProducerError(f"write to {self.topic} failed: {self._error}", topic=self.topic)
        if self._position is None:
            raise ProducerError(f"write to {self.topic} not acknowledged within {timeout_s}s", topic=self.topic)
        return self._position


#: Records read per step when looking for writes acknowledged without their offsets, from the end of the range.
PLACEMENT_CHUNK = 1000
#: Seconds between attempts to read a partition back while its leader is unavailable.
PLACEMENT_RETRY_S = 0.5


def _find_from_the_end(consumer: Any, gap: _Gap, start: int, end: int, timeout_s: float) -> list[int | None]:
    """The offsets of ``gap``'s records in ``[start, end)``: matched from the end, latest first, in send order."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    offsets: list[int | None] = [None] * len(gap.members)
    todo = len(gap.members) - 1
    while todo >= 0 and end > start:
        chunk_start = max(start, end - PLACEMENT_CHUNK)
        consumer.assign([TopicPartition(gap.topic, gap.partition, chunk_start)])
        chunk: list[tuple[int, _Record]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            msg = consumer.poll(max(0.0, min(1.0, deadline - time.monotonic())))
            if msg is None:
                if time.monotonic() >= deadline:
                    raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "reading the partition back timed out"))
                continue
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    break
                raise KafkaException(msg.error())
            if msg.offset() >= end:
                break
            chunk.append((msg.offset(), _record_of(msg)))
            if msg.offset() == end - 1:
                break
        for offset, record in reversed(chunk):
            if todo >= 0 and record == gap.members[todo][1]:
                offsets[todo] = offset
                todo -= 1
        end = chunk_start
    return offsets


#: A broker that is down fails each connection attempt, several times a second: each kind of transient error is
#: logged at most once in this many seconds, with how often it recurred in between.
ERROR_LOG_INTERVAL_S = 30.0


class _ErrorLog:
    """The producer's transient errors, each kind (Kafka's error code) logged at most once per interval."""

    def __init__(self, interval_s: float = ERROR_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s, self._clock = interval_s, clock
        self._last: dict[int, tuple[float, int]] = {}  # error code -> (when logged, repeats since)

    def __call__(self, code: int, text: str) -> None:
        now = self._clock()
        last = self._last.get(code)
        if last is not None and now - last[0] < self._interval_s:
            self._last[code] = (last[0], last[1] + 1)
            return
        self._last[code] = (now, 0)
        repeats = f" (and {last[1]} more like it in the last {now - last[0]:.0f}s)" if last and last[1] else ""
        logger.warning("Kafka producer: %s%s", text, repeats)


class _LibrdkafkaLog:
    """librdkafka's log, to ``logging``; a failed connection (facility ``FAIL``) is left to the error callback,
    which reports the same failure through :class:`_ErrorLog`."""

    def __init__(self) -> None:
        self._logger = logging.getLogger(f"{__name__}.librdkafka")

    def log(self, level: int, msg: str, *args: Any) -> None:
        if args and args[0] == "FAIL":
            return
        self._logger.log(level, msg, *args)


class ChangeProducer:
    """Writes :class:`Change` events for one primary service. Not shareable across processes."""

    def __init__(self, connection: Mapping[str, str], settings: ProducerSettings | None = None) -> None:
        from confluent_kafka import KafkaException, Producer

        self.settings = settings or ProducerSettings()
        self._connection = dict(connection)
        conf = self.settings.client_config(self._connection)
        self._librdkafka_log = _LibrdkafkaLog()
        conf["logger"] = self._librdkafka_log
        conf["error_cb"] = self._on_error
        self._error_log = _ErrorLog()
        try:
            self._producer = Producer(conf)
        except KafkaException as exc:
            raise ProducerError(f"invalid producer configuration: {exc.args[0].str()}") from exc
        self._failures: list[str] = []
        self._fatal: str | None = None
        self._known_topics: set[str] = set()
        self._in_transaction = False
        self._last_seq: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._seq_undo: list[tuple[tuple[str, bytes], int | None]] = []  # this transaction's changes to _last_seq
        self._last_offset: dict[tuple[str, int], int] = {}  # per partition, the last offset acknowledged with one
        self._open_gaps: dict[tuple[str, int], _Gap] = {}  # per partition, offsets unknown since then
        self._check_reachable()
        if self.settings.transactional_id:
            try:
                self._producer.init_transactions(self.settings.connect_timeout_s)
            except Exception as exc:
                raise ProducerError(f"initialising transactions failed: {exc}") from exc

    @property
    def bootstrap_servers(self) -> str:
        return self._connection.get("bootstrap.servers", "")

    def _check_reachable(self) -> None:
        try:
            self._producer.list_topics(timeout=self.settings.connect_timeout_s)
        except Exception as exc:
            raise ProducerError(
                f"cannot reach Kafka at {self.bootstrap_servers} within {self.settings.connect_timeout_s:.0f}s "
                f"({exc}): check bootstrap servers and that the brokers are up"
            ) from exc

    def _check_topic(self, topic: str) -> None:
        if topic in self._known_topics:
            return
        try:
            metadata = self._producer.list_topics(topic=topic, timeout=self.settings.connect_timeout_s)
        except Exception as exc:
            raise ProducerError(
                f"cannot look up topic {topic!r} on {self.bootstrap_servers} ({exc})", topic=topic
            ) from exc
        info = metadata.topics.get(topic)
        if info is None or info.error is not None:
            raise ProducerError(
                f"topic {topic!r} does not exist on {self.bootstrap_servers}: create it first, with safe "
                "settings (replica_lib.topics.TopicAdmin.ensure)",
                topic=topic,
            )
        self._known_topics.add(topic)

    def _on_error(self, err: Any) -> None:
        if err.fatal():
            self._fatal = str(err)
            logger.error("fatal Kafka producer error: %s", err)
        else:
            self._error_log(err.code(), str(err))

    # ------------------------------------------------------------------ writes
    def send(self, topic: str, change: Change, headers: Mapping[str, bytes] | None = None) -> Delivery:
        """Queue one change; returns a :class:`Delivery`. Blocks briefly if the local queue is full.

        Raises :class:`LateChangeError` for a ``seq`` lower than one already written for the key (see
        :attr:`ProducerSettings.on_lower_seq`); an equal ``seq`` (the same change sent again) is written.
        """
        key = encode_key(change.key)
        if change.seq is not None and self.settings.on_lower_seq != "allow":
            self._check_seq(topic, key, change)
        delivery = self.send_raw(topic, key, encode_value(change), headers)
        if change.seq is not None and self.settings.seq_keys_tracked:
            self._remember_seq((topic, key), change.seq)
        return delivery

    def _check_seq(self, topic: str, key: bytes, change: Change) -> None:
        last = self._last_seq.get((topic, key))
        if last is None or change.seq is None or change.seq >= last:
            return
        message = (
            f"a change of key {key.decode()} on topic {topic} has seq {change.seq}, after seq {last} was written: "
            "every replica keeps the higher one, but Kafka's compaction keeps the last record of a key, so a "
            "rebuild from a compacted topic would keep this one; write a key's changes in seq order"
        )
        if self.settings.on_lower_seq == "refuse":
            raise LateChangeError(message, topic, key)
        logger.warning("%s (written: on_lower_seq='warn')", message)

    def _remember_seq(self, slot: tuple[str, bytes], seq: int) -> None:
        last = self._last_seq.get(slot)
        if self._in_transaction:
            self._seq_undo.append((slot, last))
        self._last_seq[slot] = seq if last is None else max(last, seq)
        self._last_seq.move_to_end(slot)
        while len(self._last_seq) > self.settings.seq_keys_tracked:
            self._last_seq.popitem(last=False)

    def send_raw(
        self, topic: str, key: bytes, value: bytes | None, headers: Mapping[str, bytes] | None = None
    ) -> Delivery:
        """Queue one record already encoded (another format than the contract's JSON, e.g. for the benchmark)."""
        from confluent_kafka import KafkaException

        if self._fatal:
            raise ProducerError(f"the producer hit a fatal error and must be recreated: {self._fatal}", topic)
        if self.settings.transactional_id and not self._in_transaction:
            raise ProducerError("a transactional producer writes only inside `with producer.transaction():`")
        self._check_topic(topic)
        delivery = Delivery(self, topic)

        def on_delivery(err: Any, msg: Any) -> None:
            if err is not None:
                reason = str(err)
                self._failures.append(f"{topic}: {reason}")
                delivery._complete(None, reason)
            else:
                self._acknowledged(delivery, msg)

        while True:
            try:
                self._producer.produce(
                    topic, value=value, key=key, headers=dict(headers or {}) or None, on_delivery=on_delivery
                )
                break
            except BufferError:
                self._producer.poll(0.1)  # local queue full: serve callbacks, then retry
            except KafkaException as exc:  # refused before queueing, e.g. a record over message.max.bytes
                reason = exc.args[0].str()
                raise ProducerError(f"write to {topic} refused: {reason}", topic=topic, key=key) from exc
        self._producer.poll(0)
        return delivery

    def upsert(
        self,
        topic: str,
        key: Mapping[str, Any],
        data: Mapping[str, Any],
        seq: int | None = None,
        ts_ms: int | None = None,
        table: str | None = None,
    ) -> Delivery:
        """Send an upsert of the full row ``data``."""
        return self.send(topic, Change(key=key, op="upsert", data=data, seq=seq, ts_ms=ts_ms, table=table))

    def delete(
        self,
        topic: str,
        key: Mapping[str, Any],
        seq: int | None = None,
        ts_ms: int | None = None,
        table: str | None = None,
    ) -> Delivery:
        """Send an ``op: delete`` envelope."""
        return self.send(topic, Change(key=key, op="delete", seq=seq, ts_ms=ts_ms, table=table))

    def tombstone(self, topic: str, key: Mapping[str, Any]) -> Delivery:
        """Send a Kafka tombstone (null value) for ``key``: deletes it, and lets compaction drop it later."""
        return self.send(topic, Change(key=key, op="delete", tombstone=True))

    def write(self, topic: str, change: Change) -> Position:
        """Send one change and wait for its acknowledgement (slow: one round trip; prefer :meth:`send`)."""
        return self.send(topic, change).result(self.settings.delivery_timeout_ms / 1000)

    def _acknowledged(self, delivery: Delivery, msg: Any) -> None:
        """Record an acknowledgement; librdkafka reports a partition's acknowledgements in log order."""
        slot = (msg.topic(), msg.partition())
        offset = msg.offset()
        if offset is None:
            gap = self._open_gaps.get(slot)
            if gap is None:
                gap = self._open_gaps[slot] = _Gap(slot[0], slot[1], after=self._last_offset.get(slot))
            gap.members.append((delivery, _record_of(msg)))
            delivery._complete_in(gap)
            return
        gap = self._open_gaps.pop(slot, None)
        if gap is not None:
            gap.before = offset
        self._last_offset[slot] = offset
        delivery._complete(Position(slot[0], slot[1], offset), None)

    def _place(self, gap: _Gap, timeout_s: float) -> None:
        """Find the offsets of ``gap``'s writes by reading their partition back (see :class:`_Gap`)."""
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        # What a partition whose leader is moving (or whose broker is coming back) answers for a while, whether
        # librdkafka flags it retriable or not.
        moving = {
            KafkaError._UNKNOWN_PARTITION,
            KafkaError._TRANSPORT,
            KafkaError.UNKNOWN_TOPIC_OR_PART,
            KafkaError.LEADER_NOT_AVAILABLE,
            KafkaError.NOT_LEADER_FOR_PARTITION,
        }
        if self._open_gaps.get((gap.topic, gap.partition)) is gap:
            del self._open_gaps[(gap.topic, gap.partition)]  # writes acknowledged later open a gap of their own
        config = {
            **self._connection,
            "group.id": "replica-producer-placement",  # assigned, never subscribed: the group is not joined
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_uncommitted",  # this producer's own open transaction included
            "logger": self._librdkafka_log,
        }
        where = f"{gap.topic} [{gap.partition}]"
        deadline = time.monotonic() + timeout_s
        end = gap.before  # the range's end, once known (the high watermark if no later offset came)
        while True:
            consumer = Consumer(config)  # a new one each time: a client's metadata can hold on to a stale answer
            try:
                low, high = consumer.get_watermark_offsets(TopicPartition(gap.topic, gap.partition), timeout_s)
                start = low if gap.after is None else max(low, gap.after + 1)
                end = high if gap.before is None else gap.before
                offsets = _find_from_the_end(consumer, gap, start, end, max(1.0, deadline - time.monotonic()))
                # Read whole, unless retention (or a deletion of records) took the range's start: a write of a
                # producer's first in the partition is no older than the log's start was when it began.
                complete = gap.after is None or low <= gap.after + 1
                break
            except KafkaException as exc:  # e.g. the partition's leader moving: ask again until the deadline
                error = exc.args[0]
                transient = error.retriable() or error.code() in moving
                if transient and time.monotonic() + PLACEMENT_RETRY_S < deadline:
                    time.sleep(PLACEMENT_RETRY_S)
                    continue
                offsets = [None] * len(gap.members)
                where += f" ({error.str()})"
                complete = False
                break
            finally:
                consumer.close()
        gap.placed = True
        searched = "from the log's start" if gap.after is None else f"after offset {gap.after}"
        if end is not None:
            searched += f" up to offset {end}"
        if complete:
            searched += (
                ", where it would be: it was most likely refused (a partition not ready yet) and acknowledged when a "
                "later write was taken, so treat it as not written and what follows it as ahead of it"
            )
        else:
            searched += ": whether it was written is unknown (librdkafka acknowledges refused writes too)"
        for (delivery, _), offset in zip(gap.members, offsets, strict=True):
            if offset is None:
                delivery._unplaced = f"{where} {searched}"
            else:
                delivery._complete(Position(gap.topic, gap.partition, offset), None)
        found = [o for o in offsets if o is not None]
        logger.info("%d write(s) to %s acknowledged without their offsets were found at %s", len(found), where, found)

    # ------------------------------------------------------------------ transactions
    @contextlib.contextmanager
    def transaction(self) -> Iterator[ChangeProducer]:
        """Writes inside are committed together on normal exit and aborted if the block raises."""
        from confluent_kafka import KafkaException

        if not self.settings.transactional_id:
            raise ProducerError("transaction() needs ProducerSettings(transactional_id=...)")
        if self._in_transaction:
            raise ProducerError("transactions do not nest")
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise ProducerError(f"beginning a transaction failed: {exc.args[0].str()}") from exc
        self._in_transaction = True
        self._seq_undo.clear()
        try:
            try:
                yield self
            except BaseException:
                self._abort()
                raise
            try:
                self.flush()
                self._producer.commit_transaction(self.settings.transaction_timeout_ms / 1000)
            except KafkaException as exc:
                self._abort()
                reason = exc.args[0].str()
                raise ProducerError(f"committing the transaction failed, aborted: {reason}") from exc
            except BaseException:
                self._abort()
                raise
        finally:
            self._in_transaction = False

    def _abort(self) -> None:
        for slot, last in reversed(self._seq_undo):  # the aborted writes never happened
            if last is None:
                self._last_seq.pop(slot, None)
            else:
                self._last_seq[slot] = last
        self._seq_undo.clear()
        try:
            self._producer.abort_transaction(self.settings.transaction_timeout_ms / 1000)
        finally:
            self._failures.clear()  # the aborted writes are reported by the exception that aborted them

    # ------------------------------------------------------------------ completion
    def _serve_until(self, done: threading.Event, timeout_s: float) -> None:
        """Send what lingers and serve delivery callbacks until ``done`` is set or ``timeout_s`` has passed.

        Unlike :meth:`flush` this reports nothing: each :class:`Delivery` reports its own outcome.
        """
        if not done.is_set():
            self._producer.flush(timeout_s)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued change is acknowledged; raises if any failed or some remain."""
        timeout = self.settings.delivery_timeout_ms / 1000 if timeout_s is None else timeout_s
        remaining = self._producer.flush(timeout)
        if self._failures:
            failures, self._failures = self._failures, []
            raise ProducerError(f"{len(failures)} change(s) were not written; first: {failures[0]}")
        if remaining:
            raise ProducerError(f"{remaining} change(s) still unacknowledged after {timeout:.0f}s")

    def close(self, timeout_s: float | None = None) -> None:
        """Flush everything; the producer must not be used afterwards."""
        self.flush(timeout_s)

    def __enter__(self) -> ChangeProducer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(ProducerError):
                self._producer.flush(5)
