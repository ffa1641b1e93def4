"""The quarantine as users act on it: what is in it, which keys it holds, and records replayed or dropped.

A record is *unresolved* until ``<quarantine>__resolved`` lists it (replayed after a fix, or dropped with a
reason). The unresolved records of a table with ``on_poison = "hold_key"`` hold their keys: the replica applies no
later record of such a key (it quarantines them too, as held) until they are resolved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_lib.config import ReplicaConfig, resolved_location
from replica_lib.merge import append_resolved
from replica_lib.target import TableSchema, is_empty, latest_version, read_table, table_exists

COORDINATES = ["topic", "partition", "offset"]
REPLAYED, DROPPED = "replayed", "dropped"


def unresolved(spark: SparkSession, cfg: ReplicaConfig, resolved_version: int | None = None) -> DataFrame | None:
    """The replica's quarantined records not replayed or dropped (None if it has no quarantine table yet).

    ``resolved_version``: as the list of resolutions stood at that version (-1: before it existed)."""
    if not table_exists(spark, cfg.quarantine):
        return None
    records = read_table(spark, cfg.quarantine)
    done = resolutions(spark, cfg, resolved_version)
    if done is not None:
        records = records.join(done.select(*COORDINATES), COORDINATES, "left_anti")
    return records.dropDuplicates(COORDINATES)


def resolutions(spark: SparkSession, cfg: ReplicaConfig, version: int | None = None) -> DataFrame | None:
    """The records listed as replayed or dropped (``action``), at ``version`` of the list (None: its latest; -1:
    before it existed); None where there is no list."""
    resolved = resolved_location(cfg.quarantine)
    if (version is not None and version < 0) or not table_exists(spark, resolved):
        return None
    return read_table(spark, resolved, version)


def resolutions_version(spark: SparkSession, cfg: ReplicaConfig) -> int:
    """The latest version of the list of resolutions (-1 if there is none yet), to read it as it is now later."""
    version = latest_version(spark, resolved_location(cfg.quarantine))
    return -1 if version is None else version


def held_keys(spark: SparkSession, cfg: ReplicaConfig, schema: TableSchema) -> DataFrame | None:
    """The keys of ``schema``'s table that unresolved records hold, as its key columns (None if none can be)."""
    if is_empty(spark, cfg.quarantine):  # no quarantine, or an empty one, holds no key (known without a Spark job)
        return None
    records = unresolved(spark, cfg)
    if records is None or "held_key" not in records.columns:
        return None
    key = F.from_json(F.col("held_key"), schema.key_schema)
    mine = records.where((F.col("table") == schema.table.name) & F.col("held_key").isNotNull())
    return mine.select(*[key[k].alias(k) for k in schema.table.keys]).distinct()


@dataclass(frozen=True)
class Reason:
    """Unresolved records that share a reason: how many, of which tables, and a few of their coordinates."""

    reason: str
    records: int
    tables: tuple[str, ...]
    samples: tuple[str, ...]  # topic/partition/offset


def reasons(spark: SparkSession, cfg: ReplicaConfig, samples: int = 3) -> list[Reason]:
    """The unresolved records grouped by reason, the most frequent first."""
    records = unresolved(spark, cfg)
    if records is None:
        return []
    place = F.concat_ws("/", "topic", F.col("partition").cast("string"), F.col("offset").cast("string"))
    rows = (
        records.groupBy("reason")
        .agg(
            F.count(F.lit(1)).alias("records"),
            F.sort_array(F.collect_set(F.coalesce("table", F.lit("?")))).alias("tables"),
            F.slice(F.sort_array(F.collect_list(F.struct("partition", "offset", place.alias("at")))), 1, samples)[
                "at"
            ].alias("samples"),
        )
        .orderBy(F.desc("records"), "reason")
        .collect()
    )
    return [Reason(r["reason"], int(r["records"]), tuple(r["tables"]), tuple(r["samples"])) for r in rows]


def resolve(spark: SparkSession, cfg: ReplicaConfig, records: DataFrame, action: str, note: str) -> None:
    """List ``records`` (quarantine rows) as ``action`` (replayed or dropped) with ``note``."""
    rows = records.select(
        *COORDINATES,
        "table",
        F.lit(action).alias("action"),
        F.lit(note).alias("note"),
        F.current_timestamp().alias("resolved_at"),
    )
    append_resolved(resolved_location(cfg.quarantine), rows)


def select(records: DataFrame, tables: Sequence[str], offsets: Sequence[str]) -> DataFrame:
    """``records`` of the given tables and at the given ``topic/partition/offset`` places (all if none given)."""
    if tables:
        records = records.where(F.col("table").isin(*tables))
    if offsets:
        places = [tuple(o.split("/")) for o in offsets]
        match = F.lit(False)
        for topic, partition, offset in places:
            match = match | (
                (F.col("topic") == topic) & (F.col("partition") == int(partition)) & (F.col("offset") == int(offset))
            )
        records = records.where(match)
    return records
