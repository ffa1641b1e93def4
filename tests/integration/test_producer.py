"""The producer library against the real embedded broker: what is acknowledged is exactly what is read."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import pytest
from confluent_kafka import Consumer

from replica_dev.embedded_kafka import EmbeddedKafka, free_port
from replica_lib.errors import LateChangeError, ProducerError
from replica_lib.producer import (
    Change,
    ChangeProducer,
    Delivery,
    Position,
    ProducerSettings,
    _Gap,
    encode_key,
    encode_value,
)
from replica_lib.topics import TopicAdmin, TopicSpec

pytestmark = pytest.mark.integration

TopicFactory = Callable[..., str]


@dataclass(frozen=True)
class Record:
    position: Position
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]


def consume(
    connection: Mapping[str, str],
    topics: Iterable[str],
    until: Callable[[dict[Position, Record]], bool],
    isolation: str = "read_committed",
    timeout_s: float = 30.0,
    assigned: int | None = None,
) -> dict[Position, Record]:
    """Read ``topics`` from the start (fresh group) until ``until(records)`` holds; fail at the deadline.

    ``assigned``: read that partition of each topic instead, with no consumer group (no coordinator to wait for).
    """
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    consumer = Consumer(
        {
            **connection,
            "group.id": f"test-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    records: dict[Position, Record] = {}
    try:
        if assigned is None:
            consumer.subscribe(list(topics))
        else:
            consumer.assign([TopicPartition(topic, assigned, OFFSET_BEGINNING) for topic in topics])
        deadline = time.monotonic() + timeout_s
        while not until(records):
            assert time.monotonic() < deadline, f"gave up after {timeout_s}s with {len(records)} record(s)"
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            position = Position(msg.topic(), msg.partition(), msg.offset())
            records[position] = Record(position, msg.key(), msg.value(), tuple(msg.headers() or ()))
    finally:
        consumer.close()
    return records


def has_all(positions: Iterable[Position]) -> Callable[[dict[Position, Record]], bool]:
    wanted = set(positions)
    return lambda records: wanted <= records.keys()


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` (the Java client's default partitioner hash), as an unsigned 32-bit int."""
    m, mask = 0x5BD1E995, 0xFFFFFFFF
    h = (0x9747B28C ^ len(data)) & mask
    whole = len(data) // 4 * 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & mask
        k ^= k >> 24
        k = (k * m) & mask
        h = ((h * m) & mask) ^ k
    tail = data[whole:]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h


def java_partition(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def test_murmur2_matches_kafka_test_vectors() -> None:
    # From Kafka's UtilsTest.testMurmur2 (signed Java ints).
    vectors = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"abc": 479470107,
    }
    for data, signed in vectors.items():
        assert murmur2(data) == signed & 0xFFFFFFFF, data


# ---------------------------------------------------------------------------------------------- round trip
def test_every_acknowledged_change_is_read_back_exactly(
    connection: dict[str, str], topic_factory: TopicFactory
) -> None:
    topic = topic_factory(partitions=3)
    changes = [
        *(
            Change(
                key={"order_id": i},
                data={"order_id": i, "status": "new", "note": "café"},
                seq=1,
                ts_ms=1000 + i,
                table="orders",
            )
            for i in range(12)
        ),
        Change(key={"order_id": 3}, data={"order_id": 3, "status": "paid"}, seq=2),
        Change(key={"order_id": 4}, op="delete", seq=2, ts_ms=2000),
        Change(key={"order_id": 4}, op="delete", tombstone=True),
        Change(key={"order_id": 5}, op="delete"),
    ]

    with ChangeProducer(connection) as producer:
        deliveries = [producer.send(topic, change, headers={"source": b"orders-service"}) for change in changes]
        producer.flush()
        assert all(d.done for d in deliveries)
        positions = [d.result() for d in deliveries]

    assert all(p.topic == topic and 0 <= p.partition < 3 and p.offset >= 0 for p in positions)
    assert len(set(positions)) == len(changes)
    records = consume(connection, [topic], has_all(positions))
    assert set(records) == set(positions)  # nothing else was written
    for change, position in zip(changes, positions, strict=True):
        record = records[position]
        assert record.key == encode_key(change.key)
        assert record.value == encode_value(change)
        assert record.headers == (("source", b"orders-service"),)
    tombstone = records[positions[changes.index(Change(key={"order_id": 4}, op="delete", tombstone=True))]]
    assert tombstone.value is None


def test_same_key_always_lands_in_the_same_partition_as_the_java_client_picks(
    connection: dict[str, str], topic_factory: TopicFactory
) -> None:
    partitions = 6
    topic = topic_factory(partitions=partitions)
    keys = [{"order_id": i, "region": "eu"} for i in range(20)]
    by_key: dict[bytes, list[Position]] = {}

    for _ in range(2):  # two producers, as after a restart of the primary service
        with ChangeProducer(connection) as producer:
            for seq, key in enumerate(keys * 2):
                position = producer.write(topic, Change(key=key, data={**key, "v": seq}, seq=seq))
                by_key.setdefault(encode_key(key), []).append(position)

    for key_bytes, key_positions in by_key.items():
        assert {p.partition for p in key_positions} == {java_partition(key_bytes, partitions)}
        offsets = [p.offset for p in key_positions]
        assert offsets == sorted(offsets)  # in send order within the partition
    assert len({p.partition for ps in by_key.values() for p in ps}) > 1


# ---------------------------------------------------------------------------------------------- transactions
def test_committed_transaction_is_visible_and_aborted_one_only_to_read_uncommitted(
    connection: dict[str, str], topic_factory: TopicFactory
) -> None:
    orders, payments = topic_factory(partitions=1), topic_factory(partitions=1)
    settings = ProducerSettings(transactional_id=f"tx-{uuid.uuid4().hex}")

    with ChangeProducer(connection, settings) as producer:
        with producer.transaction():
            committed = [
                producer.upsert(orders, {"order_id": 1}, {"order_id": 1, "status": "paid"}, seq=1),
                producer.upsert(payments, {"payment_id": 9}, {"payment_id": 9, "amount": 5.0}, seq=1),
            ]
        committed_at = [d.result() for d in committed]

        with pytest.raises(RuntimeError, match="primary rolled back"), producer.transaction():
            aborted = [
                producer.upsert(orders, {"order_id": 2}, {"order_id": 2, "status": "new"}, seq=1),
                producer.delete(payments, {"payment_id": 9}, seq=2),
            ]
            aborted_at = [d.result() for d in aborted]  # acknowledged: really in the log
            raise RuntimeError("primary rolled back")

        with producer.transaction():  # written after the aborted one: once read, everything before was read
            after = [
                producer.upsert(orders, {"order_id": 3}, {"order_id": 3, "status": "new"}, seq=1),
                producer.tombstone(payments, {"payment_id": 8}),
            ]
        after_at = [d.result() for d in after]

    assert [p.topic for p in committed_at] == [orders, payments]
    assert [p.topic for p in aborted_at] == [orders, payments]
    assert all(a.offset > c.offset for a, c in zip(aborted_at, committed_at, strict=True))

    committed_view = consume(connection, [orders, payments], has_all(after_at), isolation="read_committed")
    assert set(committed_at) | set(after_at) <= committed_view.keys()
    assert not set(aborted_at) & committed_view.keys()
    assert {r.key for r in committed_view.values()} == {
        encode_key({"order_id": 1}),
        encode_key({"payment_id": 9}),
        encode_key({"order_id": 3}),
        encode_key({"payment_id": 8}),
    }

    uncommitted_view = consume(connection, [orders, payments], has_all(after_at), isolation="read_uncommitted")
    assert set(aborted_at) <= uncommitted_view.keys()
    assert uncommitted_view[aborted_at[0]].value == encode_value(
        Change(key={"order_id": 2}, data={"order_id": 2, "status": "new"}, seq=1)
    )
    assert uncommitted_view[aborted_at[1]].value == encode_value(Change(key={"payment_id": 9}, op="delete", seq=2))
    assert committed_view[committed_at[1]].value == encode_value(
        Change(key={"payment_id": 9}, data={"payment_id": 9, "amount": 5.0}, seq=1)
    )


def test_transactional_producer_refuses_writes_outside_a_transaction(
    connection: dict[str, str], topic_factory: TopicFactory
) -> None:
    topic = topic_factory(partitions=1)
    producer = ChangeProducer(connection, ProducerSettings(transactional_id=f"tx-{uuid.uuid4().hex}"))

    with pytest.raises(ProducerError, match="only inside"):
        producer.upsert(topic, {"id": 1}, {"id": 1})
    with pytest.raises(ProducerError, match="do not nest"), producer.transaction(), producer.transaction():
        pass
    producer.close()


def test_plain_producer_has_no_transactions(connection: dict[str, str]) -> None:
    producer = ChangeProducer(connection)

    with pytest.raises(ProducerError, match="transactional_id"), producer.transaction():
        pass


# ---------------------------------------------------------------------------------------------- failures
def test_writing_to_a_missing_topic_names_it(connection: dict[str, str]) -> None:
    missing = f"missing-{uuid.uuid4().hex[:10]}"

    with ChangeProducer(connection) as producer, pytest.raises(ProducerError, match=missing) as info:
        producer.upsert(missing, {"id": 1}, {"id": 1})

    assert info.value.topic == missing
    assert TopicAdmin(connection).describe(missing) is None  # and the lookup did not create it


def test_unreachable_broker_fails_fast() -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()

    with pytest.raises(ProducerError, match=f"cannot reach Kafka at {address}"):
        ChangeProducer({"bootstrap.servers": address}, ProducerSettings(connect_timeout_s=2))

    assert time.monotonic() - started < 15


def test_record_over_the_client_limit_is_refused_with_its_topic(
    connection: dict[str, str], topic_factory: TopicFactory
) -> None:
    topic = topic_factory(partitions=1)

    with ChangeProducer(connection) as producer, pytest.raises(ProducerError, match=topic) as info:
        producer.upsert(topic, {"id": 1}, {"id": 1, "blob": "x" * 2_000_000})

    assert info.value.key == encode_key({"id": 1})


def test_a_rejected_write_fails_its_delivery_without_failing_the_others(
    connection: dict[str, str], topic_factory: TopicFactory
) -> None:
    small = f"small-{uuid.uuid4().hex[:10]}"
    TopicAdmin(connection).ensure(
        TopicSpec.local(small, partitions=1, extra=(("max.message.bytes", "1024"),)), local=True
    )
    ok_topic = topic_factory(partitions=1)
    blob = os.urandom(8192).hex()  # incompressible enough to stay over 1 KiB on the wire

    producer = ChangeProducer(connection)
    too_big = producer.upsert(small, {"id": 1}, {"id": 1, "blob": blob})
    fine = producer.upsert(ok_topic, {"id": 1}, {"id": 1})

    assert fine.result().topic == ok_topic
    with pytest.raises(ProducerError, match=small) as info:
        too_big.result()
    assert "too large" in str(info.value).lower() or "MSG_SIZE_TOO_LARGE" in str(info.value)
    with pytest.raises(ProducerError, match="1 change\\(s\\) were not written"):
        producer.flush()  # failures never vanish: flush reports it too
    producer.flush()  # reported once; nothing left
    records = consume(connection, [ok_topic], has_all([fine.result()]))
    assert list(records) == [fine.result()]


def test_rejected_write_inside_a_transaction_aborts_it(connection: dict[str, str], topic_factory: TopicFactory) -> None:
    topic = topic_factory(partitions=1)
    missing = f"missing-{uuid.uuid4().hex[:10]}"
    producer = ChangeProducer(connection, ProducerSettings(transactional_id=f"tx-{uuid.uuid4().hex}"))

    with pytest.raises(ProducerError, match=missing), producer.transaction():
        written = producer.upsert(topic, {"id": 1}, {"id": 1}).result()  # in the log, not yet committed
        producer.upsert(missing, {"id": 2}, {"id": 2})
    with producer.transaction():
        marker = producer.upsert(topic, {"id": 3}, {"id": 3})
    producer.close()

    records = consume(connection, [topic], has_all([marker.result()]))
    assert written.offset < marker.result().offset
    assert list(records) == [marker.result()]


def test_abort_fails_the_deliveries_still_queued(connection: dict[str, str], topic_factory: TopicFactory) -> None:
    topic = topic_factory(partitions=1)
    settings = ProducerSettings(transactional_id=f"tx-{uuid.uuid4().hex}", linger_ms=30_000)
    producer = ChangeProducer(connection, settings)

    with pytest.raises(RuntimeError, match="rolled back"), producer.transaction():
        queued = producer.upsert(topic, {"id": 1}, {"id": 1})  # lingers in the local queue
        raise RuntimeError("rolled back")

    with pytest.raises(ProducerError, match=topic):
        queued.result(timeout_s=5)
    producer.close(timeout_s=5)  # the purged write is reported by the exception that aborted it


def test_result_sends_a_lingering_write_at_once(connection: dict[str, str], topic_factory: TopicFactory) -> None:
    topic = topic_factory(partitions=1)
    producer = ChangeProducer(connection, ProducerSettings(linger_ms=60_000))
    started = time.monotonic()

    position = producer.upsert(topic, {"id": 1}, {"id": 1}).result(timeout_s=20)

    assert time.monotonic() - started < 20
    assert position == Position(topic, 0, 0)
    producer.close()


class _Seen(logging.Handler):
    """Sets ``event`` when librdkafka logs ``facility`` (with ``containing`` in the line)."""

    def __init__(self, facility: str, containing: str = "") -> None:
        super().__init__(level=1)
        self.facility, self.containing, self.event = facility, containing, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if args and isinstance(args, tuple) and args[0] == self.facility and self.containing in record.getMessage():
            self.event.set()


def _serve_until(producer: ChangeProducer, done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll the producer (librdkafka's log reaches Python only then) until ``done()``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        producer._producer.poll(0.2)


def test_a_write_acknowledged_without_its_offset_still_gets_its_exact_position(
    kafka: EmbeddedKafka, connection: dict[str, str], topic_factory: TopicFactory
) -> None:
    """librdkafka acknowledges a timed-out request's writes without offsets when a later request succeeds first."""
    topic = topic_factory(partitions=1)
    # Requests time out after 8 s; with socket.max.fails=0 the connection stays up, so a later request can succeed.
    settings = ProducerSettings(extra=(("socket.timeout.ms", "8000"), ("socket.max.fails", "0"), ("debug", "protocol")))
    producer = ChangeProducer(connection, settings)
    first = producer.write(topic, Change(key={"id": 0}, data={"id": 0}))
    sent, timed_out = _Seen("SEND", "ProduceRequest"), _Seen("REQTMOUT")
    librdkafka_log = logging.getLogger("replica_lib.producer.librdkafka")
    librdkafka_log.addHandler(sent)
    librdkafka_log.addHandler(timed_out)
    level = librdkafka_log.level
    librdkafka_log.setLevel(1)
    a_change, b_change = Change(key={"id": 1}, data={"id": 1}), Change(key={"id": 2}, data={"id": 2})
    assert kafka.pid is not None
    os.kill(kafka.pid, signal.SIGSTOP)  # the broker hears nothing and answers nothing
    try:
        a = producer.send(topic, a_change)
        _serve_until(producer, sent.event.is_set, 30, "the first request was never sent")
        # librdkafka looks for timed-out requests once a second: the second request goes out 4 s after the first
        # (half its timeout), so that only the first has timed out when the broker answers both.
        b_after = time.monotonic() + 4
        _serve_until(producer, lambda: time.monotonic() >= b_after or a.done, 30, "")
        assert not a.done, "the first request was answered while the broker was paused"
        b = producer.send(topic, b_change)
        _serve_until(producer, timed_out.event.is_set, 30, "the first request never timed out")
    finally:
        os.kill(kafka.pid, signal.SIGCONT)
        librdkafka_log.removeHandler(sent)
        librdkafka_log.removeHandler(timed_out)
        librdkafka_log.setLevel(level)
    a_position, b_position = a.result(), b.result()
    producer.close()

    assert a._gap is not None, "a was acknowledged with its offset: the case under test did not happen"
    assert a_position == Position(topic, 0, first.offset + 1)
    assert b_position == Position(topic, 0, first.offset + 2)
    # Read back by assignment: after the pause a consumer group's first read (its coordinator) took over 30 s once
    # on a slow machine, and once found nothing in 240 s, while the partition itself was readable.
    records = consume(connection, [topic], has_all([a_position, b_position]), timeout_s=60, assigned=0)
    assert (records[a_position].key, records[a_position].value) == (encode_key(a_change.key), encode_value(a_change))
    assert (records[b_position].key, records[b_position].value) == (encode_key(b_change.key), encode_value(b_change))


def test_writes_acknowledged_without_offsets_are_placed_among_other_producers_records(
    connection: dict[str, str], topic_factory: TopicFactory
) -> None:
    topic = topic_factory(partitions=1)
    ours, theirs = ChangeProducer(connection), ChangeProducer(connection)

    def write(producer: ChangeProducer, change: Change) -> int:
        return producer.write(topic, change).offset

    def write_to(name: str, change: Change) -> int:
        return ours.write(name, change).offset

    same = Change(key={"id": 7}, data={"id": 7, "v": "same"})
    before = write(ours, Change(key={"id": 1}, data={"id": 1}))
    write(theirs, same)  # the same bytes as one of ours, before it
    x = write(ours, Change(key={"id": 2}, data={"id": 2}))
    write(theirs, Change(key={"id": 2}, data={"id": 2, "v": "theirs"}))
    y = write(ours, same)
    write(theirs, same)  # the same bytes again, after ours
    z = write(ours, Change(key={"id": 3}, op="delete", tombstone=True))
    after = write(ours, Change(key={"id": 4}, data={"id": 4}))
    copy = write(theirs, Change(key={"id": 2}, data={"id": 2}))  # the same bytes as x, after this producer's next

    def placed(
        members: list[Change], after_offset: int | None, before_offset: int | None, in_topic: str = topic
    ) -> list[Position]:
        gap = _Gap(in_topic, 0, after=after_offset, before=before_offset)
        deliveries = [Delivery(ours, in_topic) for _ in members]
        for delivery, change in zip(deliveries, members, strict=True):
            gap.members.append((delivery, (encode_key(change.key), encode_value(change), ())))
            delivery._complete_in(gap)
        return [d.result() for d in deliveries]

    x_change, tombstone = Change(key={"id": 2}, data={"id": 2}), Change(key={"id": 3}, op="delete", tombstone=True)
    # Between this producer's known neighbours, each write is found where it is, other producers' records between.
    assert [p.offset for p in placed([x_change, tombstone], before, after)] == [x, z]
    # A write whose bytes another producer wrote again later is placed at the latest copy: never before its own.
    assert [p.offset for p in placed([x_change, same, tombstone], before, after)] == [x, y + 1, z]
    # The next known offset bounds the range; with none yet, the high watermark does, and a later copy is taken.
    assert [p.offset for p in placed([x_change], before, after)] == [x]
    assert [p.offset for p in placed([x_change], before, None)] == [copy]
    # With no earlier known offset (the first write to the partition), the range starts at the log's start.
    assert [p.offset for p in placed([Change(key={"id": 1}, data={"id": 1}), x_change], None, y)] == [before, x]
    # A write that is not in the range is an error that says so, not a position: it was refused, not written.
    with pytest.raises(ProducerError, match=r"without its offset, and not found .* treat it as not written"):
        placed([Change(key={"id": 9}, data={"id": 9})], before, after)
    # Its bytes are only before the range.
    with pytest.raises(ProducerError, match="acknowledged without its offset, and not found"):
        placed([Change(key={"id": 1}, data={"id": 1})], x, after)
    # The range's start deleted (as retention does): not finding a write there says nothing, and the error says so.
    admin, deleting = TopicAdmin(connection), f"t-{uuid.uuid4().hex[:10]}"
    admin.ensure(TopicSpec.local(deleting, partitions=1, compact=False), local=True)
    first, gone, last = (write_to(deleting, Change(key={"id": i}, data={"id": i})) for i in range(3))
    admin.delete_records_before(deleting, {0: last})
    with pytest.raises(ProducerError, match="whether it was written is unknown"):
        placed([Change(key={"id": 1}, data={"id": 1})], first, last, in_topic=deleting)
    assert gone == first + 1
    ours.close()
    theirs.close()


def test_a_write_acknowledged_without_its_offset_whose_partition_cannot_be_read_is_of_unknown_fate(
    connection: dict[str, str],
) -> None:
    producer = ChangeProducer(connection)
    missing = f"t-{uuid.uuid4().hex[:10]}"  # never created: reading it back fails until the deadline
    gap = _Gap(missing, 0, after=None)
    delivery = Delivery(producer, missing)
    gap.members.append((delivery, (encode_key({"id": 1}), None, ())))
    delivery._complete_in(gap)
    with pytest.raises(ProducerError, match="whether it was written is unknown"):
        delivery.result(timeout_s=2)
    producer.close()


def test_a_lower_seq_after_a_higher_one_is_refused_before_it_is_written(
    connection: dict[str, str], topic_factory: TopicFactory, caplog: pytest.LogCaptureFixture
) -> None:
    topic = topic_factory(partitions=1)
    key = {"order_id": 1}
    with ChangeProducer(connection) as producer:
        written = [producer.upsert(topic, key, {**key, "status": "paid"}, seq=5).result()]
        with pytest.raises(LateChangeError, match=r"has seq 4, after seq 5 was written") as refused:
            producer.upsert(topic, key, {**key, "status": "new"}, seq=4)
        assert refused.value.topic == topic and refused.value.key == encode_key(key)
        written.append(producer.upsert(topic, key, {**key, "status": "paid"}, seq=5).result())  # the same, again
        written.append(producer.upsert(topic, {"order_id": 2}, {"order_id": 2}, seq=1).result())  # another key
        written.append(producer.tombstone(topic, key).result())  # no seq: nothing to compare
    with ChangeProducer(connection, ProducerSettings(on_lower_seq="warn")) as producer:
        producer.upsert(topic, key, {**key, "status": "paid"}, seq=7).result()
        late = producer.upsert(topic, key, {**key, "status": "new"}, seq=6).result()
    assert any("has seq 6, after seq 7 was written" in r.getMessage() for r in caplog.records)
    records = consume(connection, [topic], has_all([late]))
    in_log = [r.value for _, r in sorted(records.items(), key=lambda item: item[0].offset)]
    paid = encode_value(Change(key=key, data={**key, "status": "paid"}, seq=5))
    assert [p.offset for p in written] == [0, 1, 2, 3]  # the refused change took no offset: it was never sent
    assert in_log[:2] == [paid, paid] and len(in_log) == 6  # then the other key, the tombstone, seq 7, late seq 6


def test_an_aborted_transaction_leaves_no_seq_behind(connection: dict[str, str], topic_factory: TopicFactory) -> None:
    topic = topic_factory(partitions=1)
    key = {"order_id": 1}
    settings = ProducerSettings(transactional_id=f"tx-{uuid.uuid4().hex}")
    with ChangeProducer(connection, settings) as producer:
        with producer.transaction():
            producer.upsert(topic, key, key, seq=1)
        with pytest.raises(RuntimeError, match="rolled back"), producer.transaction():
            producer.upsert(topic, key, key, seq=9)
            raise RuntimeError("rolled back")
        with producer.transaction():  # seq 9 never happened: 2 follows 1
            producer.upsert(topic, key, key, seq=2)
        with pytest.raises(LateChangeError), producer.transaction():
            producer.upsert(topic, key, key, seq=1)
