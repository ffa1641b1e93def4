"""The state of a merge-on-read table in SQL: the order in which a query of it reads the three tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from replica_dev.conf import orders_table, replica_doc
from replica_lib.config import MERGE_ON_READ, parse_replica
from replica_lib.layout import state_sql
from replica_lib.target import PROVENANCE_COLUMNS, table_schema


@pytest.mark.parametrize("whole", [False, True])
def test_a_query_of_the_state_takes_the_change_logs_snapshot_before_the_other_tables(
    spark: SparkSession, tmp_path: Path, whole: bool
) -> None:
    """A fold writes the base and the retained deletes before it retires the changes it applied: a reader that
    takes the change log's snapshot first finds every change in one of its reads. The catalog's view cannot pin
    the change log's version, so the order in which Spark resolves the query's tables is what keeps it exact:
    with none of the three tables there, the one Spark fails on first is the one it resolves first."""
    doc = replica_doc("shop", tmp_path, "b:9092", {"lines": orders_table("l", layout=MERGE_ON_READ)})
    cfg = parse_replica(doc, "shop.toml", {})
    schema = table_schema(cfg.table("lines"), cfg.source_file)
    paths = {name: tmp_path / "absent" / name for name in ("base", "changes", "deletes")}
    state = state_sql(schema, *(f"delta.`{paths[name]}`" for name in ("base", "changes", "deletes")), whole=whole)
    columns = ", ".join(f"`{f.name}`" for f in schema.kept.fields)
    for query in (state, f"SELECT {columns} FROM ({state}) AS state"):  # as itself, and as the catalog's view
        with pytest.raises(AnalysisException) as failed:
            spark.sql(query)
        named = [name for name, path in paths.items() if str(path) in str(failed.value)]
        assert named == ["changes"], str(failed.value).splitlines()[0]


@pytest.mark.parametrize("whole", [False, True])
def test_the_state_of_a_table_ordered_by_log_refuses_a_key_with_changes_in_two_partitions(
    spark: SparkSession, tmp_path: Path, whole: bool
) -> None:
    """A reader is refused rather than shown one of two changes the log cannot order; a key whose pending
    change is of its row's partition reads as before."""
    from pyspark.errors import PySparkException

    table = {k: v for k, v in orders_table("l", layout=MERGE_ON_READ).items() if k != "sequence_by"}
    cfg = parse_replica(replica_doc("shop", tmp_path, "b:9092", {"lines": table}), "shop.toml", {})
    schema = table_schema(cfg.table("lines"), cfg.source_file)
    fields = schema.replica_schema

    def rows(*changes: tuple[int, str, int, int]) -> list[dict[str, object]]:
        return [
            {f.name: None for f in fields}
            | {"order_id": key, "status": status, "_src_topic": "l", "_src_partition": p, "_src_offset": o}
            for key, status, p, o in changes
        ]

    spark.createDataFrame(rows((1, "a", 0, 5), (2, "a", 0, 6)), fields).createOrReplaceTempView("lines_base")
    spark.createDataFrame([], fields).select("order_id", *PROVENANCE_COLUMNS).createOrReplaceTempView("lines_deletes")
    pending = spark.createDataFrame(rows((1, "b", 0, 9), (2, "b", 1, 3)), fields).withColumn("_op", F.lit("upsert"))
    pending.createOrReplaceTempView("lines_changes")
    state = state_sql(schema, "lines_base", "lines_changes", "lines_deletes", whole=whole)
    with pytest.raises(PySparkException) as caught:
        spark.sql(f"SELECT count(*) FROM ({state})").collect()  # an aggregate: every column pruned but the check
    assert caught.value.getCondition() == "USER_RAISED_EXCEPTION"
    moved = 'key {"order_id":2} of table lines has changes in partitions 0 and 1 of topic l'
    assert caught.value.getMessageParameters()["errorMessage"] == moved

    pending.where("order_id = 1").createOrReplaceTempView("lines_changes")
    assert sorted((r["order_id"], r["status"]) for r in spark.sql(state).collect()) == [(1, "b"), (2, "a")]
