"""Rebuilds from the log beside the live replica, and their verification, on a real broker, Spark and Delta."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from delta.tables import DeltaTable
from pyspark.sql import SparkSession

from jobs.rebuild import main as rebuild_main
from jobs.verify import main as verify_main
from replica_dev import loadgen
from replica_dev.chaos import kill_a_rebuild
from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_dev.model import LoggedChange
from replica_lib.batch import BatchHooks
from replica_lib.config import ReplicaConfig, Target, load_replica
from replica_lib.errors import LateChangeError, RebuildError
from replica_lib.layout import fold, read_state
from replica_lib.producer import ChangeProducer, ProducerSettings
from replica_lib.progress import applied_offsets
from replica_lib.rebuild import rebuild, rebuild_config
from replica_lib.status import render, status_of
from replica_lib.stream import run_replica
from replica_lib.swap import swap
from replica_lib.target import applied_target, changes_target, read_table, table_schema, tombstone_target
from replica_lib.topics import TopicAdmin, TopicSpec
from tests.integration.support import (
    delete,
    end_offsets,
    expected_df,
    produce,
    produce_garbage,
    replica_df,
    tombstone,
    upsert,
)
from tests.integration.test_semantics import assert_matches_model, rows_by_key

pytestmark = pytest.mark.integration


def _live(tmp_path: Path, bootstrap: str, topic: str, metrics: bool = False) -> tuple[str, ReplicaConfig]:
    path = tmp_path / "live.toml"
    doc = replica_doc(
        "live",
        tmp_path / "live",
        bootstrap,
        {"orders": orders_table(topic)},
        source={"starting_offsets": "earliest", "max_offsets_per_trigger": 200},
        trigger={"available_now": True},
        replica={"metrics": {"path": str(tmp_path / "live" / "_metrics")}} if metrics else {},
    )
    write_replica(path, doc)
    return str(path), load_replica(path)


def _assert_rebuilt_like_live(
    spark: SparkSession, live: ReplicaConfig, into: Path, log: list[LoggedChange]
) -> ReplicaConfig:
    """The rebuild into ``into`` equals the model of ``log`` and records the offsets the live replica applied."""
    rebuilt = rebuild_config(live, str(into))
    assert_matches_model(spark, rebuilt, log)
    live_offsets = applied_offsets(spark, live.table("orders").target)
    rebuilt_offsets = applied_offsets(spark, rebuilt.table("orders").target)
    assert live_offsets is not None and rebuilt_offsets is not None
    assert rebuilt_offsets.offsets == live_offsets.offsets
    return rebuilt


def _version(spark: SparkSession, target: Target) -> int:
    return int(DeltaTable.forPath(spark, str(target.path)).history(1).first()["version"])


def test_a_rebuild_beside_the_live_replica_equals_it_and_verify_finds_a_planted_difference(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = topic_factory(partitions=3)
    conf, live = _live(tmp_path, connection["bootstrap.servers"], topic)
    with ChangeProducer(connection) as producer:
        log = loadgen.run(producer, topic, loadgen.Workload(keys=60, events=300, seed=11))
    # Late changes (a lower seq after a higher one), Kafka tombstones and deletes of keys never written.
    log += produce(
        connection,
        topic,
        [upsert(k, 1, "late") for k in range(1, 11)]
        + [tombstone(k) for k in range(11, 16)]
        + [delete(k, 10**6) for k in range(900, 903)],
    )
    garbage = produce_garbage(connection, topic, partition=0)
    run_replica(spark, live, available_now=True)  # two batches of 200 offsets: the rebuild's one must equal them
    assert_matches_model(spark, live, log)

    # A rebuild killed at a random moment of its work (SIGKILL, driver and JVM), then run again, finishes the same.
    into = tmp_path / "rebuilt"
    kill_a_rebuild(Path(conf), into, tmp_path / "killed-rebuild.log", seed=11, within_s=4.0)
    assert rebuild_main([conf, "--into", str(into), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "live.orders and rebuilt orders are equal" in out
    rebuilt = _assert_rebuilt_like_live(spark, live, into, log)
    (bad,) = read_table(spark, rebuilt.quarantine).select("partition", "offset").collect()
    assert (bad["partition"], bad["offset"]) == (0, garbage)

    # Run again: the same plan, nothing written twice.
    version = _version(spark, rebuilt.table("orders").target)
    rebuild(spark, live, str(into))
    assert _version(spark, rebuilt.table("orders").target) == version
    assert [tuple(r) for r in read_table(spark, rebuilt.quarantine).select("partition", "offset").collect()] == [
        (0, garbage)
    ]

    # A planted difference is found, by key, with both sides' rows.
    key = sorted(row["order_id"] for row in read_table(spark, rebuilt.table("orders").target).collect())[0]
    spark.sql(f"UPDATE delta.`{into}/orders` SET status = 'planted' WHERE order_id = {key}")
    assert verify_main([conf, "--rebuilt", str(into)]) == 1
    out = capsys.readouterr().out
    assert "differ in 1 of 1024 key buckets" in out
    assert f'{{"order_id": {key}}}' in out and '"status": "planted"' in out


def test_a_point_in_time_rebuild_survives_a_crash_and_a_replica_goes_on_from_it(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = topic_factory(partitions=2)
    _, live = _live(tmp_path, connection["bootstrap.servers"], topic)
    with ChangeProducer(connection) as producer:
        log = loadgen.run(producer, topic, loadgen.Workload(keys=40, events=200, seed=5))
    log += produce(connection, topic, [tombstone(k) for k in range(1, 6)])
    cut = {p: max(e.position.offset for e in log if e.position.partition == p) // 2 for p in (0, 1)}
    before = [e for e in log if e.position.offset < cut[e.position.partition]]
    into = tmp_path / "as_of"

    class Crash(Exception):
        pass

    def crash(point: str, _batch: int) -> None:
        if point == "after_tombstones":
            raise Crash(point)

    with pytest.raises(Crash):
        rebuild(spark, live, str(into), until={topic: cut}, hooks=BatchHooks(at=crash))
    rebuild(spark, live, str(into))  # run again without --until: it finishes the recorded plan
    as_of = rebuild_config(live, str(into))
    assert_matches_model(spark, as_of, before)
    applied = applied_offsets(spark, as_of.table("orders").target)
    assert applied is not None and applied.offsets == {topic: cut}

    # The live replica's tables were never touched; a replica on the rebuilt tables with a new checkpoint goes on
    # from the rebuild's offsets and applies the rest exactly once.
    assert not Path(str(live.table("orders").target.path)).exists()
    resumed = replace(rebuild_config(live, str(into)), checkpoint=str(tmp_path / "resumed_checkpoint"))
    with caplog.at_level(logging.WARNING, logger="replica_lib.recovery"):
        run_replica(spark, resumed, available_now=True)
    resumed_from = json.dumps({topic: {str(p): o for p, o in cut.items()}})
    assert any(f"applied the log up to {resumed_from}" in r.getMessage() for r in caplog.records)
    assert_matches_model(spark, resumed, log)


def test_preflight_refuses_a_log_whose_first_records_are_gone(
    spark: SparkSession, connection: dict[str, str], tmp_path: Path
) -> None:
    topic = f"trimmed-{uuid.uuid4().hex[:8]}"
    admin = TopicAdmin(connection)
    admin.ensure(TopicSpec.local(topic, partitions=2, compact=False), local=True)
    _, live = _live(tmp_path, connection["bootstrap.servers"], topic)
    produce(connection, topic, [upsert(k, 1, "new") for k in range(20)])
    admin.delete_records_before(topic, {1: 2})  # what retention does to the oldest segment

    into = tmp_path / "rebuilt"
    with pytest.raises(RebuildError, match=r"no longer holds its first records \(partition 1 starts at 2\)"):
        rebuild(spark, live, str(into))
    assert not (into / "orders").exists()
    assert not (into / "_rebuild" / "_rebuild.json").exists()


#: The swap test's tables: one of each layout, in one replica, each fed by a topic of its own.
LAYOUTS = {"orders": "copy-on-write", "orders_mor": "merge-on-read"}


def test_a_swap_replaces_a_wrong_live_replica_in_one_commit_and_the_replica_goes_on_exactly_once(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Both layouts in one replica (a swap replaces a replica's tables one after another, each in its own commit),
    # so that the runs, the rebuild and the swap's own work are done once for both.
    topics = {table: topic_factory(partitions=3) for table in LAYOUTS}
    path = tmp_path / "live.toml"
    doc = replica_doc(
        "live",
        tmp_path / "live",
        connection["bootstrap.servers"],
        {table: orders_table(topics[table], layout=layout) for table, layout in LAYOUTS.items()},
        source={"starting_offsets": "earliest", "max_offsets_per_trigger": 300},
        trigger={"available_now": True},
    )
    write_replica(path, doc)
    live = load_replica(path)
    log: dict[str, list[LoggedChange]] = {}
    # Two batches of the live replica (300 offsets each) before the rebuild.
    for table, topic in topics.items():
        with ChangeProducer(connection) as producer:
            log[table] = loadgen.run(producer, topic, loadgen.Workload(keys=60, events=200, seed=23), table)
        late = [upsert(k, 1, "late") for k in range(1, 6)] + [tombstone(k) for k in (6, 7)]
        log[table] += produce(connection, topic, late, table)
    run_replica(spark, live, available_now=True)
    into = tmp_path / "rebuilt"
    rebuild(spark, live, str(into))

    # The live replica reads on past the rebuild's end, then its tables go wrong (a bad release, a stray UPDATE).
    garbage: dict[str, int] = {}
    for table, topic in topics.items():
        log[table] += produce(
            connection, topic, [upsert(k, 10**6, "after") for k in range(50, 70)] + [tombstone(8)], table
        )
        garbage[table] = produce_garbage(connection, topic, partition=1)
    run_replica(spark, live, available_now=True)
    # Fold the merge-on-read table's pending changes, so that the base's wrong rows show.
    fold(spark, live.name, table_schema(live.table("orders_mor"), ""))
    old: dict[str, set[tuple[Any, ...]]] = {}
    new: dict[str, set[tuple[Any, ...]]] = {}  # the model, once: nothing is written to the log until the swap ends
    before: dict[str, int] = {}
    for table in LAYOUTS:
        target = live.table(table).target
        spark.sql(f"UPDATE delta.`{target.path}` SET status = 'planted'")
        old[table], new[table] = _state(spark, live, table), _model_state(spark, live, table, log[table])
        assert old[table] != new[table]
        before[table] = _version(spark, target)
    changes_before = _version(spark, changes_target(live.table("orders_mor")))

    # Killed between the two commits of each table's swap (the first table's in the first run, the second's in the
    # next), then run again; at every step a reader sees the old state or the new one of each table.
    class Crash(Exception):
        pass

    seen: list[str] = []
    read: dict[tuple[Any, ...], set[tuple[Any, ...]]] = {}  # a table's state by the files it was read from

    def look(point: str) -> None:
        for table in LAYOUTS:
            stamp = (table, _files(live, table))
            if stamp not in read:  # the same files read the same rows: read again only after a write
                read[stamp] = _state(spark, live, table)
            assert read[stamp] in (old[table], new[table]), f"a reader saw neither state of {table} at {point}"
        seen.append(point)
        if point == "after_tombstones" and seen.count(point) in (1, 3):
            raise Crash(point)

    for _ in range(2):
        with pytest.raises(Crash):
            swap(spark, live, str(into), at=look)
    swapped = swap(spark, live, str(into), at=look)
    assert seen.count("after_plan") == 3 and seen.count("after_table") == 3
    assert swapped.caught_up == 2 * 22 and not swapped.already
    assert swapped.plan.ends == {topics[t]: {**end_offsets(log[t]), 1: garbage[t] + 1} for t in LAYOUTS}
    for table in LAYOUTS:
        assert_matches_model(spark, live, log[table], table)
    # Every version of the copy-on-write table a reader by path could read is one state or the other.
    target = live.table("orders").target
    versions = range(before["orders"], _version(spark, target) + 1)
    assert [_state(spark, live, "orders", v) in (old["orders"], new["orders"]) for v in versions] == [True] * len(
        versions
    )
    assert _state(spark, live, "orders", before["orders"]) == old["orders"]  # time travel keeps the old rows
    # So does the merge-on-read table's: its state at the change log's version before the swap is the old one.
    then = read_state(spark, live.table("orders_mor"), changes_before).collect()
    assert {(r["order_id"], r["status"], r["amount"]) for r in then} == old["orders_mor"]
    assert Path(swapped.checkpoint_aside).is_dir() and not Path(live.checkpoint).exists()
    # The rebuild's commits and the swap's record the topics' ids, as a batch's do: a start checks them.
    ids = TopicAdmin(connection).topic_ids(list(topics.values()))
    rebuilt = rebuild_config(live, str(into))
    for table in topics:  # the tables whose commits a start reads: a merge-on-read table's change log
        for target in (applied_target(live.table(table)), applied_target(rebuilt.table(table))):
            applied = applied_offsets(spark, target)
            assert applied is not None and applied.topic_ids == ids, target.describe()
    quarantined = read_table(spark, live.quarantine).select("topic", "partition", "offset").collect()
    for table, topic in topics.items():
        (bad,) = [r for r in quarantined if (r["topic"], r["offset"]) == (topic, garbage[table])]
        assert bad["partition"] == 1  # quarantined once, by the live replica before the swap

    # Started again, the replica goes on from the swap's offsets under a new checkpoint, each record once.
    for table, topic in topics.items():
        later = [upsert(k, 2 * 10**6, "later") for k in range(60, 80)] + [delete(51, 3 * 10**6)]
        log[table] += produce(connection, topic, later, table)
    with caplog.at_level(logging.WARNING, logger="replica_lib.recovery"):
        run_replica(spark, live, available_now=True)
    ends = json.dumps({t: {str(p): o for p, o in sorted(swapped.plan.ends[t].items())} for t in live.topics})
    assert any(f"applied the log up to {ends}" in r.getMessage() for r in caplog.records)
    for table in LAYOUTS:
        assert_matches_model(spark, live, log[table], table)
    assert swap(spark, live, str(into)).already
    # Its folder holds the live tables' past now: a rebuild into it again is refused, not taken as done.
    with pytest.raises(RebuildError, match=f"{into} holds a rebuild of replica live that was swapped in already"):
        rebuild(spark, live, str(into))


def _state(spark: SparkSession, cfg: ReplicaConfig, table: str, version: int | None = None) -> set[tuple[Any, ...]]:
    if version is None:
        frame = replica_df(spark, cfg, table)
    else:
        frame = spark.read.format("delta").option("versionAsOf", version).load(str(cfg.table(table).target.path))
    return {(r["order_id"], r["status"], r["amount"]) for r in frame.collect()}


def _files(cfg: ReplicaConfig, table: str) -> tuple[tuple[str, int, int], ...]:
    """Every file of the Delta tables a reader of ``table`` reads, data and log (path, size, mtime)."""
    files: list[tuple[str, int, int]] = []
    config = cfg.table(table)
    for target in (config.target, tombstone_target(config), changes_target(config)):
        assert target.path is not None  # tables by path, whose files are all there is to read
        folder = Path(target.path)
        if folder.is_dir():
            stats = ((str(p), p.stat()) for p in folder.rglob("*") if p.is_file())
            files += sorted((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)
    return tuple(files)


def _model_state(spark: SparkSession, cfg: ReplicaConfig, table: str, log: list[Any]) -> set[tuple[Any, ...]]:
    return {(r["order_id"], r["status"], r["amount"]) for r in expected_df(spark, cfg, table, log).collect()}


def test_late_changes_are_counted_refused_by_the_producer_and_a_rebuild_from_the_compacted_log_is_caught(
    spark: SparkSession,
    connection: dict[str, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Segments roll every 100 ms and any dirty share is worth cleaning: the broker's cleaner compacts the topic
    # as soon as a segment is closed.
    topic = f"late-{uuid.uuid4().hex[:8]}"
    extra = (("segment.ms", "100"), ("min.cleanable.dirty.ratio", "0.01"), ("min.compaction.lag.ms", "0"))
    TopicAdmin(connection).ensure(TopicSpec.local(topic, partitions=1, extra=extra), local=True)
    conf, live = _live(tmp_path, connection["bootstrap.servers"], topic, metrics=True)

    # The producer library refuses a late change; a primary that writes one anyway (allow) gets it counted.
    with ChangeProducer(connection) as producer:
        producer.write(topic, upsert(1, 5, "paid"))
        with pytest.raises(LateChangeError):
            producer.write(topic, upsert(1, 3, "late"))
    produce(connection, topic, [upsert(1, 3, "late"), upsert(2, 1, "new")])
    with caplog.at_level(logging.WARNING, logger="replica_lib.batch"):
        run_replica(spark, live, available_now=True)
    assert any("late changes" in r.getMessage() and "orders 1" in r.getMessage() for r in caplog.records)
    assert rows_by_key(spark, live)[1]["status"] == "paid"  # the replica keeps the higher seq
    (status,) = status_of(spark, live).tables
    assert status.late == 1
    assert "live.orders: 1 late changes seen" in render([status_of(spark, live)])

    # Kafka's cleaner keeps the last record of each key: the late one. Closed segments are compacted within a
    # second; each filler record closes the segment before it (the active segment is never cleaned).
    deadline = time.monotonic() + 120
    filler = 1000
    while _first_offset(connection, topic) == 0:
        assert time.monotonic() < deadline, "the log cleaner did not compact the topic in 120 s"
        produce(connection, topic, [upsert(filler, 1, "filler")])  # a new producer each time: 100 ms apart at least
        filler += 1
    run_replica(spark, live, available_now=True)

    # The rebuild's pre-flight names the late change the live replica counted; the rebuild from the compacted log
    # keeps it, and its verify against the live replica says so.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="replica_lib.rebuild"):
        assert rebuild_main([conf, "--into", str(tmp_path / "rebuilt"), "--verify"]) == 1
    warning = f"topic {topic} has had late changes: replica live counted 1 on table orders"
    assert any(warning in r.getMessage() for r in caplog.records)
    rebuilt = rebuild_config(live, str(tmp_path / "rebuilt"))
    assert rows_by_key(spark, rebuilt)[1]["status"] == "late"
    assert rows_by_key(spark, live)[1]["status"] == "paid"


def _first_offset(connection: dict[str, str], topic: str) -> int:
    """The offset of the first record partition 0 of ``topic`` still holds."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**connection, "group.id": f"probe-{uuid.uuid4().hex}", "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        message = consumer.poll(30)
        assert message is not None and message.error() is None
        return int(message.offset())
    finally:
        consumer.close()


def test_a_compacted_transactional_topic_rebuilds_to_the_live_replica(
    spark: SparkSession, connection: dict[str, str], tmp_path: Path
) -> None:
    # The log a rebuild meets in production: committed and aborted transactions (control records and aborted
    # records between the offsets), Kafka tombstones and deletes, then the broker's cleaner removing superseded
    # records (offset gaps). The rebuild must read past every gap and equal both the live replica and the model.
    topic = f"compacted-tx-{uuid.uuid4().hex[:8]}"
    extra = (("segment.ms", "100"), ("min.cleanable.dirty.ratio", "0.01"), ("min.compaction.lag.ms", "0"))
    TopicAdmin(connection).ensure(TopicSpec.local(topic, partitions=1, extra=extra), local=True)
    conf, live = _live(tmp_path, connection["bootstrap.servers"], topic)

    changes = loadgen.generate(loadgen.Workload(keys=30, events=120, seed=23))
    log = produce(connection, topic, changes[:60], transactional_id=f"tx-{topic}")
    aborting = ChangeProducer(connection, ProducerSettings(transactional_id=f"tx-abort-{topic}"))
    with pytest.raises(RuntimeError, match="the primary rolled back"), aborting, aborting.transaction():
        for k in range(1, 6):
            aborting.send(topic, upsert(k, 10**6, "aborted"))
        aborting.flush()
        raise RuntimeError("the primary rolled back")
    log += produce(connection, topic, changes[60:], transactional_id=f"tx-{topic}")
    log += produce(connection, topic, [tombstone(k) for k in range(6, 9)] + [delete(k, 10**6) for k in (9, 10)])
    run_replica(spark, live, available_now=True)
    assert_matches_model(spark, live, log)

    deadline = time.monotonic() + 120
    filler = 1000
    while _first_offset(connection, topic) == 0:
        assert time.monotonic() < deadline, "the log cleaner did not compact the topic in 120 s"
        log += produce(connection, topic, [upsert(filler, 1, "filler")])
        filler += 1
    run_replica(spark, live, available_now=True)
    assert_matches_model(spark, live, log)

    into = tmp_path / "rebuilt"
    assert rebuild_main([conf, "--into", str(into), "--verify"]) == 0
    _assert_rebuilt_like_live(spark, live, into, log)
