"""Every Delta MERGE of the project, built here: version-gated, tombstone-aware, idempotent per batch.

Each write of batch ``b`` is a Delta idempotent write (``txnAppId``, ``txnVersion = b``): a batch that Spark
re-executes after a crash is skipped by Delta rather than applied twice. Each commit also carries the Kafka end
offsets of the batch in its ``userMetadata``, atomically with the data (see :mod:`replica_lib.progress`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_lib.config import Target
from replica_lib.ordering import newer
from replica_lib.target import PROVENANCE_COLUMNS, TableSchema

logger = logging.getLogger(__name__)

_TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"


@dataclass(frozen=True)
class Commit:
    """Identity of one idempotent write: which app (replica, table, checkpoint generation) and which batch."""

    app_id: str
    batch_id: int
    metadata: Mapping[str, Any]

    def user_metadata(self) -> str:
        return json.dumps(self.metadata, sort_keys=True, separators=(",", ":"))


@contextlib.contextmanager
def idempotent(spark: SparkSession, commit: Commit) -> Iterator[None]:
    """Session confs that make the DML inside an idempotent Delta write carrying the commit's metadata."""
    spark.conf.set(_TXN_APP_ID, commit.app_id)
    spark.conf.set(_TXN_VERSION, str(commit.batch_id))
    spark.conf.set(_USER_METADATA, commit.user_metadata())
    try:
        yield
    finally:
        for key in (_TXN_APP_ID, _TXN_VERSION, _USER_METADATA):
            spark.conf.unset(key)


def _delta_table(spark: SparkSession, target: Target) -> Any:
    from delta.tables import DeltaTable

    if target.path:
        return DeltaTable.forPath(spark, target.path)
    return DeltaTable.forName(spark, str(target.table))


def _on_keys(keys: tuple[str, ...]) -> Column:
    condition = None
    for key in keys:
        term = F.col(f"t.`{key}`") == F.col(f"s.`{key}`")
        condition = term if condition is None else condition & term
    assert condition is not None
    return condition


def _source_newer(target_prefix: str = "t") -> Column:
    return newer(
        F.col("s._seq"),
        F.col("s._partition"),
        F.col("s._offset"),
        F.col(f"{target_prefix}._src_seq"),
        F.col(f"{target_prefix}._src_partition"),
        F.col(f"{target_prefix}._src_offset"),
    )


def _provenance() -> dict[str, Column]:
    sources = ("s._topic", "s._partition", "s._offset", "s._seq", "s._event_ts")
    return {name: F.col(src) for name, src in zip(PROVENANCE_COLUMNS, sources, strict=True)}


def merge_rows(spark: SparkSession, target: Target, winners_df: DataFrame, schema: TableSchema, commit: Commit) -> None:
    """Apply one winning change per key to the replica table: newer deletes delete, newer upserts upsert."""
    is_delete, is_upsert = F.col("s._op") == "delete", F.col("s._op") == "upsert"
    values = {f"`{f.name}`": F.col(f"s.`{f.name}`") for f in schema.kept.fields} | _provenance()
    with idempotent(spark, commit):
        (
            _delta_table(spark, target)
            .alias("t")
            .merge(winners_df.alias("s"), _on_keys(schema.table.keys))
            .whenMatchedDelete(condition=is_delete & _source_newer())
            .whenMatchedUpdate(condition=is_upsert & _source_newer(), set=values)
            .whenNotMatchedInsert(condition=is_upsert, values=values)
            .execute()
        )


def merge_tombstones(
    spark: SparkSession, target: Target, winners_df: DataFrame, schema: TableSchema, commit: Commit
) -> None:
    """Retain the newest delete per key, and drop it once a newer upsert re-inserts the key."""
    is_delete, is_upsert = F.col("s._op") == "delete", F.col("s._op") == "upsert"
    values = (
        {f"`{k}`": F.col(f"s.`{k}`") for k in schema.table.keys}
        | _provenance()
        | {
            "_deleted_at": F.current_timestamp(),
            "_app_id": F.lit(commit.app_id),
            "_batch_id": F.lit(commit.batch_id).cast("long"),
        }
    )
    with idempotent(spark, commit):
        (
            _delta_table(spark, target)
            .alias("t")
            .merge(winners_df.alias("s"), _on_keys(schema.table.keys))
            .whenMatchedUpdate(condition=is_delete & _source_newer(), set=values)
            .whenMatchedDelete(condition=is_upsert & _source_newer())
            .whenNotMatchedInsert(condition=is_delete, values=values)
            .execute()
        )


def append_quarantine(target: Target, rows_df: DataFrame, commit: Commit) -> None:
    """Append rejected records to the quarantine table (an idempotent append)."""
    writer = (
        rows_df.write.format("delta")
        .mode("append")
        .option("txnAppId", commit.app_id)
        .option("txnVersion", commit.batch_id)
        .option("userMetadata", commit.user_metadata())
    )
    if target.path:
        writer.save(target.path)
    else:
        writer.saveAsTable(str(target.table))


def delete_where(spark: SparkSession, target: Target, condition: str) -> int:
    """Delete the rows matching ``condition``; returns how many were deleted."""
    table = _delta_table(spark, target)
    table.delete(condition)
    metrics = table.history(1).select("operationMetrics").collect()[0]["operationMetrics"] or {}
    return int(metrics.get("numDeletedRows", 0))


def merge_naive(
    spark: SparkSession, path: str, changes_df: DataFrame, source_key: str, target_key: str, columns: list[str]
) -> None:
    """The hand-written upsert of Delta's documentation, kept as the benchmark's baseline (replicas never use it).

    One change per key, no version gate, no retained deletes: a delete deletes, an upsert overwrites or inserts.
    """
    from delta.tables import DeltaTable

    values = {f"`{c}`": F.col(f"s.`{c}`") for c in columns}
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(changes_df.alias("s"), F.col(f"t.`{target_key}`") == F.col(f"s.`{source_key}`"))
        .whenMatchedDelete(condition=F.col("s.op") == "delete")
        .whenMatchedUpdate(condition=F.col("s.op") == "upsert", set=values)
        .whenNotMatchedInsert(condition=F.col("s.op") == "upsert", values=values)
        .execute()
    )
