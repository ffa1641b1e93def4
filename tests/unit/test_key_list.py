"""The list of a batch's keys that a MERGE writing deletion vectors adds to its condition."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from replica_dev.conf import orders_table, replica_doc
from replica_lib import merge
from replica_lib.config import parse_replica
from replica_lib.target import TableSchema, table_schema


def schema_keyed_by(tmp_path: Path, key_type: str) -> TableSchema:
    columns = f"order_id {key_type}, status STRING"
    doc = replica_doc("shop", tmp_path, "b:9092", {"orders": orders_table("o", schema=columns)})
    cfg = parse_replica(doc, "shop.toml", {})
    return table_schema(cfg.table("orders"), cfg.source_file)


def test_the_list_selects_exactly_the_winners_keys(spark: SparkSession, tmp_path: Path) -> None:
    schema = schema_keyed_by(tmp_path, "BIGINT")
    winners = spark.createDataFrame([(7, "a"), (2, "b"), (9_000_000_000, "c")], "order_id long, status string")
    listed = merge.key_list(winners, schema, rows=3)
    assert listed is not None
    table = spark.range(0, 12).selectExpr("id AS order_id").union(spark.createDataFrame([(9_000_000_000,)], "id long"))
    found = {row[0] for row in table.alias("t").where(listed).collect()}
    assert found == {2, 7, 9_000_000_000}


def test_no_list_for_more_winners_than_the_limit_or_a_key_that_is_not_integral(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    winners = spark.createDataFrame([(1, "a"), (2, "b"), (3, "c")], "order_id long, status string")
    monkeypatch.setattr(merge, "KEY_LIST_MAX", 2)
    assert merge.key_list(winners, schema_keyed_by(tmp_path, "BIGINT"), rows=3) is None
    monkeypatch.setattr(merge, "KEY_LIST_MAX", 3)
    assert merge.key_list(winners, schema_keyed_by(tmp_path, "BIGINT"), rows=3) is not None
    named = spark.createDataFrame([("x", "a")], "order_id string, status string")
    assert merge.key_list(named, schema_keyed_by(tmp_path, "STRING"), rows=1) is None
