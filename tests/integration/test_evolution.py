"""Schema evolution: fields new in the data become columns mid-stream, conf changes evolve a table at restart,
a strict table counts what it does not keep. Every table is checked against the reference model."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality
from pyspark.sql import DataFrame, SparkSession

from replica_dev.model import LoggedChange, fold
from replica_lib.batch import BatchHooks, BatchStats
from replica_lib.config import ReplicaConfig
from replica_lib.errors import ConfigError
from replica_lib.layout import fold as fold_changes
from replica_lib.producer import Change
from replica_lib.stream import start_replica
from replica_lib.target import changes_target, delta_table, ensure_replica_tables, read_table
from tests.integration.support import RUN_TIMEOUT_S, orders_table, produce, replica_config, replica_df

pytestmark = pytest.mark.integration


def run(spark: SparkSession, cfg: ReplicaConfig) -> list[BatchStats]:
    """Apply what is in the log (one query: no restart between its batches); the figures of each batch."""
    stats: list[BatchStats] = []
    query = start_replica(spark, cfg, available_now=True, hooks=BatchHooks(after_batch=stats.append))
    try:
        assert query.awaitTermination(RUN_TIMEOUT_S), f"replica {cfg.name} did not drain the log"
    finally:
        query.stop()
    return stats


def model_df(spark: SparkSession, cfg: ReplicaConfig, table: str, log: Iterable[LoggedChange]) -> DataFrame:
    """The model's rows in the replica table's columns as they are now (a column a row never had is null)."""
    spec = cfg.table(table)
    rows = fold(list(log), {table: spec.keys}, {table: spec.sequence_by is not None})[table]
    actual = replica_df(spark, cfg, table)
    columns = actual.columns
    return spark.createDataFrame([tuple(row.get(c) for c in columns) for row in rows.values()], actual.schema)


def assert_model(spark: SparkSession, cfg: ReplicaConfig, table: str, log: Iterable[LoggedChange]) -> None:
    assert_df_equality(
        replica_df(spark, cfg, table), model_df(spark, cfg, table, log), ignore_row_order=True, ignore_nullable=True
    )


def change(order_id: int, seq: int, **extra: Any) -> Change:
    row = {"order_id": order_id, "customer": f"c{order_id}", "amount": 1.5 * seq, "status": "s", "updated_ms": seq}
    return Change(key={"order_id": order_id}, op="upsert", data=row | extra, seq=seq, ts_ms=1_700_000_000_000)


def gone(order_id: int, seq: int) -> Change:
    return Change(key={"order_id": order_id}, op="delete", seq=seq)


def user_columns(spark: SparkSession, cfg: ReplicaConfig, table: str) -> list[tuple[str, str]]:
    return [(f.name, f.dataType.simpleString()) for f in read_table(spark, cfg.table(table).target).schema.fields]


def operations(spark: SparkSession, cfg: ReplicaConfig, table: str) -> list[str]:
    history = delta_table(spark, cfg.table(table).target).history().orderBy("version")
    return [str(row["operation"]) for row in history.collect()]


def test_new_fields_become_columns_mid_stream_on_both_layouts(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    rng = random.Random(19)
    topics = {"cow": topic_factory(partitions=2), "mor": topic_factory(partitions=2)}
    narrow = "order_id BIGINT, customer STRING, amount DOUBLE, status STRING, updated_ms INT"
    tables = {
        "cow": orders_table(topics["cow"], schema=narrow),
        "mor": orders_table(topics["mor"], schema=narrow, layout="merge-on-read"),
    }
    # Small batches, so that the new fields arrive in the middle of a run.
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "evolving", tables, max_offsets_per_trigger=30)
    log: dict[str, list[LoggedChange]] = {"cow": [], "mor": []}
    seq = 0

    def write(table: str, changes: list[Change]) -> None:
        log[table] += produce(connection, topics[table], changes, table=table)

    def plain(n: int) -> list[Change]:
        nonlocal seq
        out = []
        for _ in range(n):
            seq += 1
            key = rng.randint(1, 15)
            out.append(gone(key, seq) if rng.random() < 0.15 else change(key, seq))
        return out

    for table in log:
        write(table, plain(10))  # one batch
    run(spark, cfg)
    for table in log:
        assert_model(spark, cfg, table, log[table])

    # Then, in one run of three batches: plain changes, then changes with new fields (a string, an integer, a
    # fraction, an object), then changes without them again: a row whose last change has no note reads null.
    fielded = 10  # changes with the new fields, per table
    stats: list[BatchStats] = []
    for table in log:
        newer: list[Change] = plain(20)
        for _ in range(fielded):
            seq += 1
            key = rng.randint(1, 15)
            extra = {"note": f"n{seq}", "qty": seq * 1_000_000_000, "rate": seq / 4, "meta": {"x": seq}}
            # updated_ms outgrows its INT column: widened to BIGINT in place, mid-stream.
            newer.append(change(key, seq, updated_ms=5_000_000_000 + seq, **extra))
        newer += plain(10)
        write(table, newer)
    stats = run(spark, cfg)
    # The first batch has none of the new fields (it wrote the narrow columns): they arrive mid-run.
    assert len(stats) >= 3 and not stats[0].unknown_fields, [s.unknown_fields for s in stats]
    for table in log:
        assert_model(spark, cfg, table, log[table])
        columns = user_columns(spark, cfg, table)
        assert columns[4:8] == [("updated_ms", "bigint"), ("note", "string"), ("qty", "bigint"), ("rate", "double")]
        assert ("meta", "struct<x:bigint>") not in columns and "meta" not in dict(columns)
        assert {"ADD COLUMNS", "CHANGE COLUMN"} <= set(operations(spark, cfg, table))
    # The object field is not a column: the records that carried it are counted, by field.
    carried = sum(s.unknown_fields.get("cow.meta", 0) for s in stats)
    assert carried == fielded, [s.unknown_fields for s in stats]

    # A restart keeps the added columns (they are not in the config) and goes on filling them.
    for table in log:
        seq += 1
        write(table, [change(3, seq, note="after restart", qty=7), gone(4, seq + 1)])
        seq += 1
    run(spark, cfg)
    for table in log:
        assert_model(spark, cfg, table, log[table])


def test_a_fold_started_with_the_schema_before_new_columns_keeps_their_values(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    # A fold owed while another ran, or the maintenance job's, may start with the schema read before a batch added
    # columns: it must fold the change log's new columns too, not drop their values and retire the changes.
    topic = topic_factory(partitions=1)
    narrow = "order_id BIGINT, customer STRING, amount DOUBLE, status STRING, updated_ms BIGINT"
    spec = orders_table(topic, schema=narrow, layout="merge-on-read", fold_every_batches=0)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "late_fold", {"orders": spec})
    stale = ensure_replica_tables(spark, cfg)["orders"]
    log = produce(connection, topic, [change(1, 1), change(2, 2)], table="orders")
    run(spark, cfg)
    log += produce(connection, topic, [change(1, 3, note="kept"), change(3, 4, note="new"), gone(2, 5)], table="orders")
    run(spark, cfg)
    assert "note" not in stale.kept.fieldNames()

    folded = fold_changes(spark, cfg.name, stale)
    assert (folded.keys, folded.upserted, folded.deleted) == (3, 2, 0)  # key 2 never reached the base
    assert read_table(spark, changes_target(cfg.table("orders"))).count() == 0  # retired
    base = read_table(spark, cfg.table("orders").target)
    expected = model_df(spark, cfg, "orders", log)
    assert_df_equality(base.select(*expected.columns), expected, ignore_row_order=True, ignore_nullable=True)


def test_a_one_table_replica_decodes_the_batches_after_new_columns_by_them(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, caplog: Any
) -> None:
    # A replica of one table decodes its records in the query's own plan, by the schema the query started with;
    # after a batch adds columns, the later batches of the same run decode their records again by the new schema.
    topic = topic_factory(partitions=1)
    narrow = "order_id BIGINT, customer STRING, amount DOUBLE, status STRING, updated_ms BIGINT"
    spec = orders_table(topic, schema=narrow)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "one", {"orders": spec}, max_offsets_per_trigger=5)
    first = [change(k, k) for k in range(1, 6)]
    fielded = [change(k, 10 + k, note=f"n{k}") for k in range(1, 6)]
    later = [change(2, 20, note="later"), gone(3, 21), change(4, 22), change(6, 23, note="new key"), change(1, 24)]
    log = produce(connection, topic, [*first, *fielded, *later], table="orders")
    with caplog.at_level(logging.WARNING, logger="replica_lib.batch"):
        stats = run(spark, cfg)
    assert len(stats) == 3 and [s.records for s in stats] == [5, 5, 5]
    assert_model(spark, cfg, "orders", log)
    assert ("note", "string") in user_columns(spark, cfg, "orders")
    assert any("decode each record again" in r.getMessage() for r in caplog.records)


def test_a_conf_change_adds_and_widens_columns_at_restart(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = topic_factory(partitions=2)
    narrow = "order_id BIGINT, customer STRING, amount FLOAT, status STRING, updated_ms INT"
    spec = orders_table(topic, schema=narrow, schema_evolution="strict")
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "widening", {"orders": spec})
    log = produce(connection, topic, [change(k, k) for k in range(1, 9)], table="orders")
    run(spark, cfg)
    assert_model(spark, cfg, "orders", log)

    wide = "order_id BIGINT, customer STRING, amount DOUBLE, status STRING, updated_ms BIGINT, channel STRING"
    wider = replica_config(tmp_path, connection["bootstrap.servers"], "widening", {"orders": {**spec, "schema": wide}})
    big = [change(k, k + 10, updated_ms=5_000_000_000 + k, channel="web") for k in range(3, 12)]
    log += produce(connection, topic, [*big, gone(4, 30)], table="orders")
    with caplog.at_level(logging.WARNING, logger="replica_lib.target"):
        run(spark, wider)
    assert_model(spark, wider, "orders", log)
    # The rows applied before read NULL in the new column, whatever their records held: said, with the fix.
    (said,) = [r.getMessage() for r in caplog.records if "gains column(s) channel from the config" in r.getMessage()]
    assert f"./replica rebuild {wider.source_file} --into <folder> --swap" in said
    assert user_columns(spark, wider, "orders")[:6] == [
        ("order_id", "bigint"),
        ("customer", "string"),
        ("amount", "double"),
        ("status", "string"),
        ("updated_ms", "bigint"),
        ("channel", "string"),
    ]
    assert {"ADD COLUMNS", "CHANGE COLUMN"} <= set(operations(spark, wider, "orders"))

    # Narrowing again cannot be done in place: refused before anything is written, naming the column and the fix.
    with pytest.raises(ConfigError) as refused:
        ensure_replica_tables(spark, cfg)
    assert "amount" in str(refused.value) and "rebuild" in str(refused.value)


def test_a_strict_table_counts_fields_it_does_not_keep_and_quarantines_a_changed_type(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topic = topic_factory(partitions=1)
    cfg = replica_config(
        tmp_path,
        connection["bootstrap.servers"],
        "strict",
        {"orders": orders_table(topic, schema_evolution="strict")},
    )
    changes = [change(1, 1), change(2, 2, note="kept nowhere"), change(3, 3, note="x", extra=1)]
    changes.append(change(4, 4))
    bad = Change(
        key={"order_id": 5},
        op="upsert",
        data={"order_id": 5, "customer": "c5", "amount": "a lot", "status": "s", "updated_ms": 5},
        seq=5,
    )
    log = produce(connection, topic, [*changes, bad], table="orders")
    stats = run(spark, cfg)
    assert_model(spark, cfg, "orders", log[:-1])  # the mistyped record is not applied
    assert user_columns(spark, cfg, "orders")[:5] == [
        ("order_id", "bigint"),
        ("customer", "string"),
        ("amount", "double"),
        ("status", "string"),
        ("updated_ms", "bigint"),
    ]
    counted: dict[str, int] = {}
    for s in stats:
        for name, n in s.unknown_fields.items():
            counted[name] = counted.get(name, 0) + n
    assert counted == {"orders.note": 2, "orders.extra": 1}
    quarantined = read_table(spark, cfg.quarantine).collect()
    assert [(r["offset"], r["reason"]) for r in quarantined] == [
        (4, "data does not match the table schema: amount (double)")
    ]
