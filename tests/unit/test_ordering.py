"""replica_lib.ordering: one winning change per key, which also drops records delivered twice."""

from __future__ import annotations

import random
from typing import Any

import pytest
from chispa import assert_df_equality
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession

from replica_dev.model import LoggedChange, fold
from replica_lib.ordering import LogOrder, latest_per_key
from replica_lib.producer import Change as LogChange
from replica_lib.producer import Position

CHANGES_SCHEMA = "order_id BIGINT, status STRING, _op STRING, _seq BIGINT, _tombstone BOOLEAN"
CHANGES_SCHEMA += ", _partition INT, _offset BIGINT"
CURRENT_SCHEMA = "order_id BIGINT, _cur_seq BIGINT, _cur_partition INT, _cur_offset BIGINT"
KEYS = ["order_id"]

ChangeRow = tuple[int, str | None, str, int | None, bool, int, int]


def up(order_id: int, seq: int | None, offset: int, status: str = "s", partition: int = 0) -> ChangeRow:
    return (order_id, status, "upsert", seq, False, partition, offset)


def delete(order_id: int, seq: int | None, offset: int, partition: int = 0) -> ChangeRow:
    return (order_id, None, "delete", seq, False, partition, offset)


def tomb(order_id: int, offset: int, partition: int = 0) -> ChangeRow:
    """A Kafka tombstone as decode produces it: a delete without seq."""
    return (order_id, None, "delete", None, True, partition, offset)


def with_seq(change: ChangeRow, seq: int | None) -> ChangeRow:
    """``change`` as it wins: a tombstone carries the seq it inherited."""
    return (*change[:3], seq, *change[4:])


def frame(spark: SparkSession, rows: list[Any], schema: str) -> DataFrame:
    return spark.createDataFrame(rows, schema)


def winners(spark: SparkSession, changes: list[ChangeRow], current: list[tuple[Any, ...]]) -> DataFrame:
    return latest_per_key(frame(spark, changes, CHANGES_SCHEMA), KEYS, frame(spark, current, CURRENT_SCHEMA))


def assert_winners(spark: SparkSession, actual_df: DataFrame, expected: list[ChangeRow]) -> None:
    assert actual_df.columns == [f.split()[0] for f in CHANGES_SCHEMA.split(", ")]
    assert_df_equality(actual_df, frame(spark, expected, CHANGES_SCHEMA), ignore_row_order=True, ignore_nullable=True)


def test_records_delivered_twice_count_once(spark: SparkSession) -> None:
    k1_tomb, k3_tomb = tomb(1, 2), tomb(3, 1, partition=1)
    log = [
        up(1, 4, 0, "a"),
        up(1, 3, 1, "older"),
        k1_tomb,  # inherits seq 4
        up(1, 4, 3, "again"),  # equal seq, later in the log: after the tombstone
        delete(2, 2, 4),
        up(2, 1, 5, "late"),
        k3_tomb,
        up(4, None, 6, "x"),
        up(4, None, 6, "x", partition=1),  # same offset, other partition: another record
    ]
    copies = [log[0], log[0], log[1], k1_tomb, k1_tomb, log[3], log[4], k3_tomb, log[7]]
    expected = [
        up(1, 4, 3, "again"),
        delete(2, 2, 4),
        with_seq(k3_tomb, 7),
        up(4, None, 6, "x", partition=1),
    ]
    current = [(3, 7, 1, 0)]
    assert_winners(spark, winners(spark, log + copies, current), expected)
    assert_winners(spark, winners(spark, copies + log, current), expected)  # wherever the copies are
    # A record delivered again in a later batch meets a state of equal version: it is not applied again.
    assert winners(spark, [log[3]], [(1, 4, 0, 3)]).collect() == []


def test_latest_per_key_without_current_state(spark: SparkSession) -> None:
    k5_tomb, k7_tomb, k10_tomb = tomb(5, 9), tomb(7, 13), tomb(10, 20)
    changes = [
        # key 1: the greatest seq wins, wherever it is in the log
        up(1, 1, 0, "a"),
        up(1, 3, 1, "c"),
        up(1, 2, 2, "b"),
        # key 2: equal seqs, the greater partition wins
        up(2, 5, 3, "p0"),
        up(2, 5, 0, "p1", partition=1),
        # key 3: the same change twice: the later copy wins (same row)
        up(3, 2, 4, "dup"),
        up(3, 2, 5, "dup"),
        # key 4: a delete beats an older late upsert
        delete(4, 4, 6),
        up(4, 3, 7, "late"),
        # key 5: a tombstone takes the seq of the row it deletes
        up(5, 1, 8, "x"),
        k5_tomb,
        # key 6: a tombstone alone keeps no seq
        tomb(6, 10),
        # key 7: the running max (5), not the latest seq (2); an older late upsert after it stays deleted
        up(7, 5, 11, "x"),
        up(7, 2, 12, "y"),
        k7_tomb,
        up(7, 4, 14, "late"),
        # key 8: an equal seq later in the log comes after the tombstone
        up(8, 2, 15, "x"),
        tomb(8, 16),
        up(8, 2, 17, "again"),
        # key 9: anything comes after a tombstone of nothing
        tomb(9, 18),
        up(9, 1, 19, "new"),
        # key 10: a delete with a seq, then a tombstone for compaction
        delete(10, 6, 19),
        k10_tomb,
        up(10, 5, 21, "late"),
    ]
    expected = [
        up(1, 3, 1, "c"),
        up(2, 5, 0, "p1", partition=1),
        up(3, 2, 5, "dup"),
        delete(4, 4, 6),
        with_seq(k5_tomb, 1),
        tomb(6, 10),
        with_seq(k7_tomb, 5),
        up(8, 2, 17, "again"),
        up(9, 1, 19, "new"),
        with_seq(k10_tomb, 6),
    ]
    assert_winners(spark, winners(spark, changes, []), expected)


def test_latest_per_key_against_the_current_state(spark: SparkSession) -> None:
    k6_tomb, k7_tomb, k9_tomb = tomb(6, 11), tomb(7, 20), tomb(9, 13)
    current = [
        (1, 5, 0, 10),
        (2, 5, 0, 10),
        (3, 5, 0, 10),
        (4, 5, 0, 10),
        (5, 5, 1, 3),
        (6, 5, 0, 10),
        (7, 3, 0, 10),
        (9, 9, 0, 10),
        (10, 5, 0, 10),
        (11, None, 0, 10),
    ]
    changes = [
        up(1, 5, 10, "replayed"),  # the very version the table holds: dropped
        up(2, 4, 20, "older"),  # older seq later in the log: dropped
        up(3, 6, 5, "newer"),  # newer seq, even at an earlier offset: kept
        up(4, 5, 11, "equal-seq-later"),  # equal seq, later in the log: kept
        up(5, 5, 9, "equal-seq-lower-partition"),  # equal seq, lower partition: dropped
        k6_tomb,  # a tombstone takes the table's seq (5) and comes after it
        up(7, 2, 15, "older"),  # older than the table: dropped ...
        k7_tomb,  # ... and the tombstone still takes the table's seq (3 > 2)
        up(8, 1, 0, "new-key"),  # a key the table does not know
        up(9, 8, 12, "older"),
        k9_tomb,  # takes 9 from the table, not 8 from the batch
        delete(10, 5, 10),  # a replayed delete: dropped
        delete(11, 1, 5),  # any seq is newer than none, even at an earlier offset
    ]
    expected = [
        up(3, 6, 5, "newer"),
        up(4, 5, 11, "equal-seq-later"),
        with_seq(k6_tomb, 5),
        with_seq(k7_tomb, 3),
        up(8, 1, 0, "new-key"),
        with_seq(k9_tomb, 9),
        delete(11, 1, 5),
    ]
    assert_winners(spark, winners(spark, changes, current), expected)


def test_latest_per_key_without_sequence_uses_log_position(spark: SparkSession) -> None:
    current = [(3, None, 0, 10), (7, None, 1, 0)]
    changes = [
        up(1, None, 0, "a"),
        up(1, None, 2, "c"),
        up(1, None, 1, "b"),
        up(2, None, 3, "x"),
        tomb(2, 4),
        up(3, None, 5, "replayed"),  # before the table's position: dropped
        up(4, None, 6, "x"),
        tomb(4, 7),
        up(4, None, 8, "back"),
        delete(5, None, 9),
        up(5, None, 10, "back"),
        up(6, None, 11, "x"),
        delete(6, None, 12),
        up(7, None, 20, "lower-partition"),  # partition 0 < the table's partition 1: dropped
    ]
    expected = [
        up(1, None, 2, "c"),
        tomb(2, 4),
        up(4, None, 8, "back"),
        up(5, None, 10, "back"),
        delete(6, None, 12),
    ]
    assert_winners(spark, winners(spark, changes, current), expected)


def random_log(seed: int, events: int = 40) -> list[LoggedChange]:
    """A seeded log over a few keys: out-of-order seqs, duplicates, deletes and tombstones."""
    rng = random.Random(seed)
    log: list[LoggedChange] = []
    offsets = {0: 0, 1: 0}
    for i in range(events):
        order_id = rng.randint(1, 5)
        partition = order_id % 2  # one key, one partition
        same_key = [e for e in log if e.change.key["order_id"] == order_id]
        roll = rng.random()
        if same_key and roll < 0.15:
            change = rng.choice(same_key).change  # the same change again
        elif roll < 0.3:
            change = LogChange(key={"order_id": order_id}, op="delete", seq=rng.randint(1, 6))
        elif roll < 0.4:
            change = LogChange(key={"order_id": order_id}, op="delete", tombstone=True)
        else:
            data = {"order_id": order_id, "status": f"s{i}"}
            change = LogChange(key={"order_id": order_id}, op="upsert", data=data, seq=rng.randint(1, 6))
        log.append(LoggedChange(Position("orders", partition, offsets[partition]), change, "orders"))
        offsets[partition] += 1
    return log


def as_change_row(event: LoggedChange) -> ChangeRow:
    change, pos = event.change, event.position
    status = None if change.data is None else change.data["status"]
    return (
        change.key["order_id"],
        status,
        change.op,
        change.seq,
        change.tombstone,
        pos.partition,
        pos.offset,
    )


@pytest.mark.parametrize("seed", [1, 2])
def test_latest_per_key_in_two_batches_matches_the_reference_model(spark: SparkSession, seed: int) -> None:
    log = random_log(seed)
    first, second = log[:25], log[25:]
    first_winners = winners(spark, [as_change_row(e) for e in first], []).collect()
    state = {r["order_id"]: r for r in first_winners}
    current = [(k, r["_seq"], r["_partition"], r["_offset"]) for k, r in state.items()]
    state.update({r["order_id"]: r for r in winners(spark, [as_change_row(e) for e in second], current).collect()})

    live = {
        (key,): {"order_id": key, "status": r["status"], "_src_topic": "orders", "_src_partition": r["_partition"],
                 "_src_offset": r["_offset"], "_src_seq": r["_seq"]}
        for key, r in state.items()
        if r["_op"] == "upsert"
    }  # fmt: skip
    expected = fold(log, {"orders": ("order_id",)}, {"orders": True})["orders"]
    assert live == expected
    assert any(e.change.tombstone for e in log)


STATE_SCHEMA = "order_id BIGINT, _src_seq BIGINT, _src_partition INT, _src_offset BIGINT"


def _random_log(rng: random.Random, sequenced: bool, tombstones: bool) -> list[ChangeRow]:
    """Changes of a few keys over two partitions, with copies (redeliveries), late seqs and deletes."""
    log: list[ChangeRow] = []
    offsets = [0, 0]
    for _ in range(rng.randint(1, 40)):
        key, partition = rng.randint(1, 6), rng.randint(0, 1)
        seq = rng.randint(1, 9) if sequenced else None
        kind = rng.random()
        if tombstones and kind < 0.2:
            change = tomb(key, offsets[partition], partition)
        elif kind < 0.4:
            change = delete(key, seq, offsets[partition], partition)
        else:
            change = up(key, seq, offsets[partition], rng.choice("abc"), partition)
        offsets[partition] += 1
        log.append(change)
        if rng.random() < 0.2:
            log.append(change)  # delivered twice
    return log


@pytest.mark.parametrize(("sequenced", "tombstones"), [(False, True), (True, False)])
def test_one_per_key_then_unapplied_ranks_as_the_window_does(
    spark: SparkSession, sequenced: bool, tombstones: bool
) -> None:
    # Wherever no tombstone inherits a seq (unsequenced, or no tombstones), aggregation and window agree, for any
    # known states: several per key, older and newer than the batch's changes.
    from pyspark.sql import functions as F

    from replica_lib.ordering import current_versions, one_per_key, unapplied

    rng = random.Random(7 if sequenced else 11)
    for _ in range(6):
        changes = frame(spark, _random_log(rng, sequenced, tombstones), CHANGES_SCHEMA)
        states_rows = [
            (rng.randint(1, 6), rng.randint(1, 9) if sequenced else None, rng.randint(0, 1), rng.randint(0, 30))
            for _ in range(rng.randint(0, 8))
        ]
        states = frame(spark, states_rows, STATE_SCHEMA)
        expected = latest_per_key(changes, KEYS, current_versions(KEYS, states) if states_rows else None)
        decoded = changes.withColumns({"_topic": F.lit("orders"), "_error": F.lit(None).cast("string")})
        actual = unapplied(one_per_key(decoded, KEYS), KEYS, states if states_rows else None).drop("_topic", "_error")
        assert_df_equality(actual, expected, ignore_row_order=True, ignore_nullable=True)


def test_one_per_key_keeps_one_copy_of_each_rejected_record(spark: SparkSession) -> None:
    from replica_lib.ordering import one_per_key

    rows = [up(1, 1, 0), up(1, 2, 1), up(1, 2, 1), up(2, 1, 2), up(2, 1, 2)]
    errors = [None, None, None, "bad", "bad"]
    changes = spark.createDataFrame(
        [(*r, "orders", e) for r, e in zip(rows, errors, strict=True)],
        CHANGES_SCHEMA + ", _topic STRING, _error STRING",
    )
    ranked = one_per_key(changes, KEYS).collect()
    assert sorted((r["order_id"], r["_offset"], r["_error"]) for r in ranked) == [(1, 1, None), (2, 2, "bad")]


def test_a_key_whose_last_change_in_the_log_has_a_lower_seq_is_flagged_late(spark: SparkSession) -> None:
    # The record Kafka's compaction keeps is the last one per key: where its seq is lower than the winner's, a
    # rebuild from the compacted log would differ. A resend (equal seq) and a tombstone last are not late.
    from replica_lib.ordering import one_per_key

    rows = [
        up(1, 5, 0),
        up(1, 3, 1),  # late: last in the log, lower seq
        up(2, 1, 2),
        up(2, 4, 3),  # in order
        up(3, 2, 4),
        up(3, 2, 5),  # the same seq again
        up(4, 7, 6),
        tomb(4, 7),  # a tombstone last: compaction drops the key, as the replica does
        up(5, 9, 8, partition=1),
        up(5, 2, 9, partition=1),  # late, in another partition
    ]
    errors: list[str | None] = [None] * len(rows)
    rows.append(up(6, 1, 10))
    errors.append("bad")
    changes = spark.createDataFrame(
        [(*r, "orders", e) for r, e in zip(rows, errors, strict=True)],
        CHANGES_SCHEMA + ", _topic STRING, _error STRING",
    )
    ranked = one_per_key(changes, KEYS, late=True)
    assert {r["order_id"]: r["_late"] for r in ranked.collect()} == {
        1: True,
        2: False,
        3: False,
        4: False,
        5: True,
        6: False,
    }
    assert one_per_key(changes, KEYS).columns == changes.columns  # without late=True, nothing added


BY_LOG = LogOrder("orders", "t-orders")
MOVED = 'key {"order_id":1} of table orders has changes in partitions 0 and 1 of topic t-orders'


def refused(frame_df: DataFrame) -> str:
    """The message with which ``frame_df``'s job is refused (a key of a table ordered by log position in two
    partitions): Spark's error for ``raise_error``, told by its condition."""
    with pytest.raises(PySparkException) as caught:
        frame_df.collect()
    assert caught.value.getCondition() == "USER_RAISED_EXCEPTION"
    return caught.value.getMessageParameters()["errorMessage"]


def decoded(spark: SparkSession, rows: list[ChangeRow], errors: list[str | None] | None = None) -> DataFrame:
    errors = errors or [None] * len(rows)
    return spark.createDataFrame(
        [(*r, "orders", e) for r, e in zip(rows, errors, strict=True)],
        CHANGES_SCHEMA + ", _topic STRING, _error STRING",
    )


def test_a_key_with_changes_in_two_partitions_is_refused_by_the_ranking_of_a_table_ordered_by_log(
    spark: SparkSession,
) -> None:
    """Without a seq, a key's changes are ordered within one partition only: the ranking of a batch in which a key
    has changes in two refuses it, whichever partition wins; the same batch ranks as before without one."""
    from replica_lib.ordering import one_per_key

    for rows in ([up(1, None, 4), up(1, None, 2, partition=1)], [up(1, None, 2, partition=1), up(1, None, 9)]):
        changes = decoded(spark, [up(2, None, 0), *rows, up(3, None, 1, partition=1)])
        assert refused(one_per_key(changes, KEYS, late=True, by_log=BY_LOG)) == MOVED
        assert refused(one_per_key(changes, KEYS, by_log=BY_LOG)) == MOVED
    # One partition per key, and a rejected record of key 1 elsewhere (it is quarantined, not ranked): as before.
    changes = decoded(
        spark,
        [up(1, None, 0), up(1, None, 3), up(2, None, 1, partition=1), up(1, None, 7, partition=1)],
        [None] * 3 + ["bad"],
    )
    assert_df_equality(
        one_per_key(changes, KEYS, late=True, by_log=BY_LOG),
        one_per_key(changes, KEYS, late=True),
        ignore_row_order=True,
    )


def test_a_winner_in_another_partition_than_its_keys_state_is_refused_on_a_table_ordered_by_log(
    spark: SparkSession,
) -> None:
    """Against what the tables hold (retained deletes and rows: ``unapplied``, the window's ``latest_per_key``)."""
    from replica_lib.ordering import current_versions, unapplied

    states = frame(spark, [(1, None, 0, 30), (2, None, 1, 5)], STATE_SCHEMA)
    for partition, offset in ((1, 2), (1, 40)):  # older or newer by offset: either way, not comparable
        changes = [up(1, None, offset, partition=partition), up(2, None, 9, partition=1)]
        ranked = decoded(spark, changes)
        assert refused(unapplied(ranked, KEYS, states, BY_LOG)) == MOVED
        window = latest_per_key(frame(spark, changes, CHANGES_SCHEMA), KEYS, current_versions(KEYS, states), BY_LOG)
        assert refused(window) == MOVED
    same = decoded(spark, [up(1, None, 31), up(2, None, 4, partition=1)])
    assert_df_equality(unapplied(same, KEYS, states, BY_LOG), unapplied(same, KEYS, states), ignore_row_order=True)
    assert [r["order_id"] for r in unapplied(same, KEYS, states, BY_LOG).collect()] == [1]
