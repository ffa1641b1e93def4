"""The retained deletes a copy-on-write replica holds in memory: every batch's deletes kept, in few partitions.

The anti join broadcasts the whole state every batch, in a Spark job of a task per partition held; each task costs
more than its few rows do, so the state must not grow by a partition per batch while it is small.
"""

from __future__ import annotations

from functools import reduce
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession

from replica_dev.conf import orders_table, replica_doc
from replica_lib import batch
from replica_lib.config import parse_replica
from replica_lib.target import TableSchema, table_schema

WINNERS = "order_id long, _op string, _partition int, _offset long, _seq long"


def orders_schema(tmp_path: Path) -> TableSchema:
    doc = replica_doc("shop", tmp_path, "b:9092", {"orders": orders_table("o")})
    cfg = parse_replica(doc, "shop.toml", {})
    return table_schema(cfg.table("orders"), cfg.source_file)


def held(retained: batch._Retained) -> DataFrame:
    return reduce(DataFrame.unionByName, retained.parts["orders"])


def add_batches(
    spark: SparkSession, retained: batch._Retained, schema: TableSchema, batches: int
) -> tuple[set[tuple[int, int, int, int]], list[int]]:
    """Add ``batches`` batches of winners (two partitions each, deletes and upserts): the deletes added, and the
    partitions held after each batch."""
    added, partitions = set(), []
    for b in range(batches):
        rows = [(100 * b + i, "delete" if i % 2 else "upsert", 0, 100 * b + i, b) for i in range(6)]
        winners = spark.createDataFrame(rows, WINNERS).repartition(2)
        retained.add("orders", batch._Winners(winners, rows=6, deletes=3, key_range=None), schema)
        added |= {(key, 0, offset, seq) for key, op, _, offset, seq in rows if op == "delete"}
        partitions.append(held(retained).rdd.getNumPartitions())
    return added, partitions


def start(spark: SparkSession, rows: int) -> tuple[batch._Retained, set[tuple[int, int, int, int]]]:
    """A state as read from the table: three partitions of ``rows`` deletes."""
    retained = batch._Retained()
    read = [(-1 - i, 1, i, 1) for i in range(rows)]
    frame = spark.createDataFrame(read, "order_id long, _src_partition int, _src_offset long, _src_seq long")
    retained.parts["orders"] = [frame.repartition(3)]
    retained.rows["orders"] = rows
    return retained, set(read)


def test_a_small_state_holds_every_delete_in_few_partitions(spark: SparkSession, tmp_path: Path) -> None:
    retained, expected = start(spark, 4)
    added, partitions = add_batches(spark, retained, orders_schema(tmp_path), 11)
    assert {tuple(row) for row in held(retained).collect()} == expected | added
    every = batch._Retained.COMPACT_EVERY
    # Once compacted (into one partition), the state holds it and a partition per batch since, fewer than a turn's.
    assert max(partitions[every - 1 :]) <= every, partitions


def test_a_state_too_large_to_broadcast_keeps_its_partitions_when_compacted(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch, "RETAINED_BROADCAST_ROWS", 10)
    retained, expected = start(spark, 20)
    added, _ = add_batches(spark, retained, orders_schema(tmp_path), batch._Retained.COMPACT_EVERY)
    assert {tuple(row) for row in held(retained).collect()} == expected | added
    assert len(retained.parts["orders"]) == 1 and held(retained).rdd.getNumPartitions() > 1  # read by many tasks
