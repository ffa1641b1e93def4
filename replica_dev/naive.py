"""The benchmark's naive contender: the hand-written foreachBatch MERGE of Delta's documentation."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F


def merge_naive(
    spark: SparkSession, path: str, changes_df: DataFrame, source_key: str, target_key: str, columns: list[str]
) -> None:
    """The hand-written upsert of Delta's documentation, the benchmark's baseline.

    One change per key, no version gate, no retained deletes: a delete deletes, an upsert overwrites or inserts.
    """
    from delta.tables import DeltaTable

    values: dict[str, str | Column] = {f"`{c}`": F.col(f"s.`{c}`") for c in columns}
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(changes_df.alias("s"), F.col(f"t.`{target_key}`") == F.col(f"s.`{source_key}`"))
        .whenMatchedDelete(condition=F.col("s.op") == "delete")
        .whenMatchedUpdate(condition=F.col("s.op") == "upsert", set=values)
        .whenNotMatchedInsert(condition=F.col("s.op") == "upsert", values=values)
        .execute()
    )
