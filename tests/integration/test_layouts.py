"""Merge-on-read: the state a reader sees, before and after each fold, equals the reference model; so does the base."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from jobs.rebuild import main as rebuild_main
from replica_dev import loadgen
from replica_dev.conf import replica_doc, write_replica
from replica_dev.model import LoggedChange
from replica_lib.batch import FOLD_COMPACTION_POINT, BatchHooks, BatchStats
from replica_lib.config import COPY_ON_WRITE, MERGE_ON_READ, CompactionConfig, ReplicaConfig, Target, load_replica
from replica_lib.layout import FOLD_POINTS, fold, state_sql
from replica_lib.producer import Change, ChangeProducer
from replica_lib.rebuild import rebuild_config
from replica_lib.stream import run_replica, start_replica
from replica_lib.target import (
    CHANGE_LOG_CHECKPOINTS,
    CHANGE_LOG_PARTITIONS,
    changes_target,
    current_schema,
    ensure_table,
    latest_version,
    partition_columns,
    read_table,
    table_schema,
    tombstone_target,
)
from tests.integration.support import (
    RUN_TIMEOUT_S,
    delete,
    expected_df,
    orders_table,
    produce,
    replica_config,
    replica_df,
    run_available_now,
    tombstone,
    upsert,
)

pytestmark = pytest.mark.integration


def merge_on_read(topic: str, fold_every_batches: int = 0) -> dict[str, Any]:
    return orders_table(topic, layout=MERGE_ON_READ, fold_every_batches=fold_every_batches)


def folding_replica(
    tmp_path: Path,
    connection: dict[str, str],
    topic: str,
    name: str,
    fold_every_batches: int,
    batch_size: int,
    workload: loadgen.Workload,
) -> tuple[ReplicaConfig, list[LoggedChange]]:
    """A merge-on-read replica of ``topic`` folding on that cadence, in batches of ``batch_size`` records, and the
    log of ``workload`` written to the topic."""
    cfg = replica_config(
        tmp_path,
        connection["bootstrap.servers"],
        name,
        {"orders": merge_on_read(topic, fold_every_batches=fold_every_batches)},
        max_offsets_per_trigger=batch_size,
    )
    with ChangeProducer(connection) as producer:
        return cfg, loadgen.run(producer, topic, workload)


def assert_state(spark: SparkSession, cfg: ReplicaConfig, log: list[LoggedChange]) -> None:
    """The state a reader sees equals the model, in both shapes of its query (a small base is ranked whole)."""
    table = cfg.table("orders")
    expected = sorted(tuple(r) for r in expected_df(spark, cfg, "orders", log).collect())
    names = (table.target.describe(), changes_target(table).describe(), tombstone_target(table).describe())
    shapes = {"read_state": replica_df(spark, cfg, "orders")}
    for whole in (True, False):
        query = state_sql(current_schema(spark, table), *names, whole=whole)
        shapes[f"whole={whole}"] = spark.sql(query).drop("_src_event_ts")
    for shape, rows in shapes.items():
        actual = sorted(tuple(r) for r in rows.collect())
        assert actual == expected, (
            f"{shape}: rows not in the model: {sorted(set(actual) - set(expected))}; "
            f"rows of the model missing: {sorted(set(expected) - set(actual))}"
        )


def assert_folded(spark: SparkSession, cfg: ReplicaConfig, log: list[LoggedChange]) -> None:
    """The base alone is the state, and nothing is pending."""
    table = cfg.table("orders")
    base = read_table(spark, table.target).drop("_src_event_ts")
    assert_df_equality(base, expected_df(spark, cfg, "orders", log), ignore_row_order=True)
    assert read_table(spark, changes_target(table)).count() == 0


def pending(spark: SparkSession, cfg: ReplicaConfig) -> int:
    return read_table(spark, changes_target(cfg.table("orders"))).count()


def last_checkpoint(target: Target) -> int | None:
    """The version of the table's last checkpoint, as its log's ``_last_checkpoint`` file says (None: none)."""
    assert target.path is not None
    marker = Path(target.path) / "_delta_log" / "_last_checkpoint"
    return int(json.loads(marker.read_text())["version"]) if marker.exists() else None


class RecordingLock(contextlib.AbstractContextManager[object]):
    """Stands for the lock that a replica's appends to the change log take: counts how often a fold takes it."""

    def __init__(self) -> None:
        self.taken = 0

    def __enter__(self) -> object:
        self.taken += 1
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Crash(Exception):
    pass


def crash_at(point: str) -> Any:
    def at(reached: str) -> None:
        if reached == point:
            raise Crash(point)

    return at


def test_the_state_equals_the_model_before_and_after_a_fold_and_a_fold_killed_anywhere(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topic = topic_factory(partitions=3)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "mor", {"orders": merge_on_read(topic)})
    schema = table_schema(cfg.table("orders"), cfg.source_file)
    first: list[Change] = [
        upsert(1, 1, "new"),
        upsert(1, 4, "shipped"),
        upsert(1, 2, "paid"),
        upsert(2, 5, "v5"),
        upsert(3, 1, "v1"),
        delete(3, 2),
        upsert(4, 1, "v1"),
        delete(4, 2),
        upsert(5, 3, "v3"),
        tombstone(5),  # a Kafka tombstone on a sequenced table: inherits seq 3
        delete(6, 1),
    ]
    log = produce(connection, topic, first)
    log += produce(connection, topic, first)  # delivered twice
    run_available_now(spark, cfg)
    assert_state(spark, cfg, log)
    assert read_table(spark, cfg.table("orders").target).count() == 0  # nothing folded yet: all of it pending
    assert pending(spark, cfg) > 0

    folded = fold(spark, cfg.name, schema)
    assert folded.version is not None and folded.keys == 6
    assert_folded(spark, cfg, log)
    assert_state(spark, cfg, log)
    # The fold checkpoints the change log; a batch's append does so only every CHANGE_LOG_CHECKPOINTS commits.
    changes = changes_target(cfg.table("orders"))
    assert last_checkpoint(changes) == latest_version(spark, changes)
    interval = spark.sql(f"SHOW TBLPROPERTIES {changes.describe()} ('delta.checkpointInterval')").first()
    assert interval is not None and interval["value"] == str(CHANGE_LOG_CHECKPOINTS)
    assert partition_columns(spark, changes) == CHANGE_LOG_PARTITIONS

    second: list[Change] = [
        upsert(2, 4, "v4-late"),  # older than the folded seq 5
        upsert(3, 1, "v1-late"),  # older than the folded delete: no resurrection
        upsert(4, 3, "v3-newer"),  # newer than the delete: back
        upsert(5, 2, "v2-late"),  # older than the seq the tombstone inherited
        upsert(6, 2, "v2"),
        tombstone(2),  # inherits seq 5 from the base row
        upsert(2, 5, "v5-again"),  # equal seq, later in the log: after the tombstone
    ]
    log += produce(connection, topic, second)
    run_available_now(spark, cfg)
    assert_state(spark, cfg, log)

    # A fold killed at each of its points: readers still see the state, and the next fold completes it.
    for point in FOLD_POINTS:
        with pytest.raises(Crash):
            fold(spark, cfg.name, schema, at=crash_at(point))
        assert_state(spark, cfg, log)
        log += produce(connection, topic, [upsert(7, len(log), f"after-{point}"), delete(4, 9)])
        run_available_now(spark, cfg)
        assert_state(spark, cfg, log)
    # A change log partitioned by batch is retired without the lock the batches' appends take.
    lock = RecordingLock()
    fold(spark, cfg.name, schema, retiring=lock)
    assert lock.taken == 0
    assert_folded(spark, cfg, log)
    assert fold(spark, cfg.name, schema).version is None  # nothing pending: a no-op


#: Names Delta and the replica take beside plain ones: a dot, a dash, a dollar, a bracket, a letter beyond ASCII,
#: at the top and inside a STRUCT (a query of a merge-on-read table spells each type in SQL).
ODD_NAMES_SCHEMA = "id BIGINT, `a.b` STRING, `c-d` DOUBLE, `$x` INT, `é` STRUCT<`p.q`: INT, `r[0]`: ARRAY<STRING>>"


@pytest.mark.parametrize("layout", [COPY_ON_WRITE, MERGE_ON_READ])
def test_columns_named_with_dots_dashes_and_other_letters_equal_the_model(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, layout: str
) -> None:
    topic = topic_factory(partitions=2)
    table = {"topic": topic, "keys": ["id"], "sequence_by": "seq", "schema": ODD_NAMES_SCHEMA, "layout": layout}
    folds = {"fold_every_batches": 1} if layout == MERGE_ON_READ else {}
    cfg = replica_config(
        tmp_path, connection["bootstrap.servers"], "odd", {"odd": {**table, **folds}}, max_offsets_per_trigger=3
    )

    def row(key: int, seq: int) -> Change:
        data = {"id": key, "a.b": f"v{seq}", "c-d": seq / 2, "$x": seq, "é": {"p.q": seq, "r[0]": [f"e{seq}", None]}}
        return Change(key={"id": key}, op="upsert", data=data, seq=seq)

    changes = [row(1, 1), row(2, 1), row(3, 1), row(1, 2), Change(key={"id": 2}, op="delete", seq=2), row(3, 3)]
    changes += [row(4, 1), Change(key={"id": 4}, op="delete", tombstone=True), row(1, 4), row(2, 3)]
    log = produce(connection, topic, changes, table="odd")
    run_available_now(spark, cfg)
    assert_same_rows(spark, cfg, log)
    # A column the config adds (ALTER TABLE … ADD COLUMNS spells its type in SQL too).
    grown = {**table, **folds, "schema": ODD_NAMES_SCHEMA + ", `n-1` STRUCT<`x-y`: INT>"}
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "odd", {"odd": grown}, max_offsets_per_trigger=3)
    extra = {"id": 3, "a.b": "w", "c-d": 0.5, "$x": 9, "é": None, "n-1": {"x-y": 7}}
    log += produce(connection, topic, [Change(key={"id": 3}, op="upsert", data=extra, seq=5)], table="odd")
    run_available_now(spark, cfg)
    assert_same_rows(spark, cfg, log)
    assert {r["id"] for r in expected_df(spark, cfg, "odd", log).collect()} == {1, 2, 3}  # 2 upserted after its
    # delete (seq 3 after 2); 4 tombstoned


@pytest.mark.parametrize("layout", [COPY_ON_WRITE, MERGE_ON_READ])
def test_a_not_null_column_quarantines_a_row_without_its_value_and_takes_deletes(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, layout: str
) -> None:
    """The table refuses a null in a NOT NULL column (Delta would fail the batch on it, at every restart): such an
    upsert is quarantined; a delete, which carries the key alone, is applied (a change log holds it as a row)."""
    topic = topic_factory(partitions=1)
    schema = "order_id BIGINT, customer STRING NOT NULL, amount DOUBLE, status STRING, updated_ms BIGINT NOT NULL"
    folds = {"fold_every_batches": 1} if layout == MERGE_ON_READ else {}
    table = orders_table(topic, schema=schema, layout=layout, **folds)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "required", {"orders": table})
    good = [upsert(1, 1, "a"), upsert(2, 1, "b"), delete(1, 2), upsert(3, 1, "c")]
    log = produce(connection, topic, good)
    no_customer = Change(key={"order_id": 4}, op="upsert", data={"order_id": 4, "updated_ms": 1}, seq=1)
    nothing = Change(key={"order_id": 3}, op="upsert", data={"order_id": 3, "customer": None}, seq=2)
    refused = produce(connection, topic, [no_customer, nothing])
    log += produce(connection, topic, [upsert(2, 3, "d")])
    run_available_now(spark, cfg)
    assert_df_equality(replica_df(spark, cfg, "orders"), expected_df(spark, cfg, "orders", log), ignore_row_order=True)
    quarantined = read_table(spark, cfg.quarantine).select("offset", "reason").collect()
    assert sorted((r["offset"], r["reason"]) for r in quarantined) == [
        (refused[0].position.offset, "data has no value for NOT NULL column customer"),
        (refused[1].position.offset, "data has no value for NOT NULL column customer, updated_ms"),
    ]


def assert_same_rows(spark: SparkSession, cfg: ReplicaConfig, log: list[LoggedChange]) -> None:
    """The table equals the model, compared as rows (chispa sorts by the columns' names unquoted, which Spark reads
    as a struct's fields)."""
    actual, expected = (
        sorted(df.collect(), key=repr) for df in (replica_df(spark, cfg, "odd"), expected_df(spark, cfg, "odd", log))
    )
    assert actual == expected


def test_a_change_log_made_before_its_partitions_is_retired_under_the_lock(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """A change log that an earlier release created, without partitions: Delta refuses a DELETE of its rows when
    a batch appended meanwhile, so the fold retires it holding the lock the batches' appends take."""
    topic = topic_factory(partitions=2)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "older", {"orders": merge_on_read(topic)})
    schema = table_schema(cfg.table("orders"), cfg.source_file)
    changes = changes_target(cfg.table("orders"))
    ensure_table(spark, changes, schema.changes_schema, "a change log as an earlier release made it")
    log = produce(connection, topic, [upsert(1, 1, "a"), upsert(2, 1, "b"), delete(1, 2), upsert(3, 4, "c")])
    run_available_now(spark, cfg)
    assert partition_columns(spark, changes) == ()
    assert_state(spark, cfg, log)
    lock = RecordingLock()
    fold(spark, cfg.name, schema, retiring=lock)
    assert lock.taken == 1
    assert_folded(spark, cfg, log)


def test_a_seeded_random_run_with_folds_between_batches_equals_the_model(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """600 events over 60 keys (late seqs, duplicates, deletes, tombstones), written and applied in two parts of a
    few batches each, folded every 2nd batch."""
    rng = random.Random(20261125)
    topic = topic_factory(partitions=4)
    cfg = replica_config(
        tmp_path,
        connection["bootstrap.servers"],
        "mor_random",
        {"orders": merge_on_read(topic, fold_every_batches=2)},
        max_offsets_per_trigger=rng.randint(150, 200),
    )
    keys = 60
    next_seq = dict.fromkeys(range(keys), 0)
    changes: list[Change] = []
    for _ in range(600):
        key = rng.randrange(keys)
        next_seq[key] += 1
        seq = max(1, next_seq[key] - rng.choice((0, 0, 0, 1, 2)))
        roll = rng.random()
        if roll < 0.15:
            changes.append(delete(key, seq))
        elif roll < 0.2:
            changes.append(tombstone(key))
        else:
            changes.append(upsert(key, seq, f"s{seq}", amount=round(rng.uniform(1, 100), 2)))
        if rng.random() < 0.05:
            changes.append(changes[-1])
    log: list[LoggedChange] = []
    position = 0
    while position < len(changes):
        size = rng.randint(300, 450)
        log += produce(connection, topic, changes[position : position + size])
        position += size
        run_available_now(spark, cfg)
        assert_state(spark, cfg, log)
    fold(spark, cfg.name, table_schema(cfg.table("orders"), cfg.source_file))
    assert_folded(spark, cfg, log)


def test_a_fold_runs_beside_the_batches_that_follow_and_readers_see_the_state_meanwhile(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """The replica's first fold is held between its writes (retained deletes appended, MERGE not yet run) until
    the next batch has ended: that batch runs and commits meanwhile, and the state a reader sees after it equals
    the model of the log up to its end offsets; the fold then completes beside the later batches."""
    topic = topic_factory(partitions=3)
    # Four batches of 120: the fold after batch 1 is held through batch 2; batch 3 follows.
    cfg, log = folding_replica(tmp_path, connection, topic, "mor_beside", 2, 120, loadgen.Workload(40, 450, seed=7))
    held: dict[str, Any] = {}  # the batch that started the held fold; whether it was released in time
    holding, released = threading.Event(), threading.Event()
    seen: list[tuple[int, int]] = []  # (batch id, changes of the log up to its end) read while the fold was held

    def at(point: str, batch_id: int) -> None:
        if point == FOLD_POINTS[0] and not holding.is_set():
            held["fold"] = batch_id
            holding.set()
            held["released"] = released.wait(RUN_TIMEOUT_S)  # a fold inside the batch would wait in vain

    def after_batch(stats: BatchStats) -> None:
        if stats.batch_id < 2 or released.is_set():
            return
        assert holding.wait(RUN_TIMEOUT_S), "the fold started after batch 1 never reached its first write"
        ends = stats.offsets[topic]
        upto = [c for c in log if c.position.offset < ends.get(c.position.partition, 0)]
        assert_state(spark, cfg, upto)
        seen.append((stats.batch_id, len(upto)))
        released.set()

    query = start_replica(spark, cfg, available_now=True, hooks=BatchHooks(at=at, after_batch=after_batch))
    try:
        assert query.awaitTermination(RUN_TIMEOUT_S)
    finally:
        query.stop()  # returns once the last fold has ended
    assert held == {"fold": 1, "released": True} and seen and seen[0][0] == 2, (held, seen)
    assert 0 < seen[0][1] < len(log)
    assert_state(spark, cfg, log)
    assert read_table(spark, cfg.table("orders").target).count() > 0  # the held fold went on and committed


def test_a_merge_on_read_tables_compaction_runs_after_its_fold_and_no_batch_waits_for_either(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """The compaction's turn after batch 1 falls with a fold, which is held between its writes until batch 2 has
    ended: batch 1 ends and batch 2 runs meanwhile (a batch that waited for the fold would wait in vain); the
    fold's thread packs the table's files once the fold has committed, and the state equals the model."""
    topic = topic_factory(partitions=3)
    # Four batches of 120, folded and compacted after batches 1 and 3.
    cfg, log = folding_replica(tmp_path, connection, topic, "mor_compact", 2, 120, loadgen.Workload(40, 450, seed=8))
    cfg = dataclasses.replace(cfg, compaction=CompactionConfig(every_batches=2, small_file_mb=16))
    points: list[tuple[str, int]] = []  # appended from the batches' thread and the fold's
    released = threading.Event()

    def at(point: str, batch_id: int) -> None:
        points.append((point, batch_id))
        if (point, batch_id) == (FOLD_POINTS[0], 1):
            released.wait(RUN_TIMEOUT_S / 4)

    def after_batch(stats: BatchStats) -> None:
        if stats.batch_id == 2:
            released.set()

    query = start_replica(spark, cfg, available_now=True, hooks=BatchHooks(at=at, after_batch=after_batch))
    try:
        assert query.awaitTermination(RUN_TIMEOUT_S)
    finally:
        query.stop()  # returns once the last fold and compaction have ended
    assert released.is_set(), points
    batch_compacted, folded = points.index(("after_compaction", 1)), points.index((FOLD_POINTS[1], 1))
    fold_compacted = points.index((FOLD_COMPACTION_POINT, 1))
    assert batch_compacted < folded < fold_compacted, points
    assert_state(spark, cfg, log)


def test_a_fold_that_fails_beside_the_batches_fails_the_replica_and_a_restart_loses_nothing(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """What a fold raises is not left in its thread: the replica fails with it (at its next batch, or when its
    run ends), and the next run folds the changes as if the fold had never started."""
    topic = topic_factory(partitions=2)
    # Two batches of 80: the fold after batch 0 fails, and the replica with it.
    cfg, log = folding_replica(tmp_path, connection, topic, "mor_failing", 1, 80, loadgen.Workload(30, 150, seed=5))

    def fail_the_first_fold(point: str, batch_id: int) -> None:
        if point == FOLD_POINTS[0] and batch_id == 0:
            raise Crash(f"injected fold failure after batch {batch_id}")

    with pytest.raises((StreamingQueryException, Crash), match="injected fold failure after batch 0"):
        run_replica(spark, cfg, available_now=True, hooks=BatchHooks(at=fail_the_first_fold))
    run_available_now(spark, cfg)
    assert_state(spark, cfg, log)
    fold(spark, cfg.name, table_schema(cfg.table("orders"), cfg.source_file))
    assert_folded(spark, cfg, log)


def test_a_lost_checkpoint_resumes_from_the_change_log_and_a_rebuild_equals_the_live_replica(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = topic_factory(partitions=3)
    conf = tmp_path / "live.toml"
    tables = {"orders": merge_on_read(topic, fold_every_batches=2)}
    source = {"starting_offsets": "earliest", "max_offsets_per_trigger": 150}
    doc = replica_doc("live", tmp_path / "live", connection["bootstrap.servers"], tables, source=source)
    write_replica(conf, {**doc, "trigger": {"available_now": True}})
    live = load_replica(conf)
    with ChangeProducer(connection) as producer:
        # Three batches of 150, folded after batch 1: what batch 2 appends after that fold began stays pending.
        log = loadgen.run(producer, topic, loadgen.Workload(keys=60, events=330, seed=12))
    run_available_now(spark, live)
    assert_state(spark, live, log)

    # A new checkpoint resumes where the change log's commits say, with the old checkpoint's changes still pending.
    shutil.rmtree(live.checkpoint)
    newer = produce(connection, topic, [upsert(k, 10**6, "after") for k in range(5)] + [tombstone(7)])
    log += newer
    stats: list[BatchStats] = []
    query = start_replica(spark, live, available_now=True, hooks=BatchHooks(after_batch=stats.append))
    try:
        assert query.awaitTermination(RUN_TIMEOUT_S)
    finally:
        query.stop()
    assert sum(s.records for s in stats) == len(newer)
    assert_state(spark, live, log)

    # A rebuild beside it (merge-on-read too, folded when it ends) equals it, and verify says so.
    into = tmp_path / "rebuilt"
    assert rebuild_main([str(conf), "--into", str(into), "--verify"]) == 0
    assert "live.orders and rebuilt orders are equal" in capsys.readouterr().out
    assert_folded(spark, rebuild_config(live, str(into)), log)
