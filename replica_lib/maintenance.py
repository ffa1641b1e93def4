"""Keeping a replica tidy: dropping retained deletes once that can no longer let a deleted key come back.

The tombstone table is a log the replica only appends to (one row per winning delete), so it also holds deletes
that no longer count: one superseded by a newer delete of its key, or by the key's live row (upserted again).
:func:`compact_tombstones` drops those; what any change is checked against, the greatest version among a key's
row and retained deletes, stays the same.

The rule for a retained delete (a row of ``<table>__tombstones``) of key *k* at ``(partition p, offset o)``:
it is purged only when

1. it is older than the replica's ``tombstone_retention`` (default 7 days), which bounds how late a reordered,
   older change of *k* may still arrive from the primary; and
2. the log no longer holds any record of partition *p* at or before offset *o* (the partition's log start offset
   is past *o*), so no replay can ever deliver an older change of *k* again.

On a compacted topic the log start offset does not move, so condition 2 keeps its deletes for good: the
tombstone table is then bounded by the number of deleted keys, never by the number of changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from replica_lib.config import ReplicaConfig, TableConfig
from replica_lib.merge import delete_matching, delete_where
from replica_lib.ordering import current_versions, newer
from replica_lib.target import PROVENANCE_COLUMNS, read_table, tombstone_target
from replica_lib.topics import TopicAdmin

logger = logging.getLogger(__name__)


def purge_condition(log_start: dict[str, dict[int, int]], cutoff: datetime) -> str | None:
    """The SQL predicate selecting purgeable tombstones, or None if nothing can be purged."""
    terms = [
        f"(_src_topic = '{topic}' AND _src_partition = {partition} AND _src_offset < {start})"
        for topic, partitions in sorted(log_start.items())
        for partition, start in sorted(partitions.items())
        if start > 0
    ]
    if not terms:
        return None
    stamp = cutoff.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"_deleted_at < TIMESTAMP '{stamp}' AND ({' OR '.join(terms)})"


def purge_tombstones(
    spark: SparkSession, cfg: ReplicaConfig, admin: TopicAdmin, now: datetime | None = None
) -> dict[str, int]:
    """Purge every table's retained deletes that the rule above allows; returns how many per table."""
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=cfg.tombstone_retention_s)
    purged = {}
    for table in cfg.tables:
        condition = purge_condition({table.topic: admin.earliest_offsets(table.topic)}, cutoff)
        purged[table.name] = delete_where(spark, tombstone_target(table), condition) if condition else 0
        logger.info("replica %s table %s: purged %d retained deletes", cfg.name, table.name, purged[table.name])
    return purged


def compact_tombstones(spark: SparkSession, table: TableConfig) -> int:
    """Drop a table's retained deletes that a newer delete or the live row of their key supersedes.

    Safe while the replica runs: its tombstone writes are blind appends, which never conflict with this delete,
    and a row it removes meanwhile is removed by a newer delete, which is retained.
    """
    keys = list(table.keys)
    version_cols = [*keys, *PROVENANCE_COLUMNS[1:4]]  # keys, _src_partition, _src_offset, _src_seq
    tombstones = read_table(spark, tombstone_target(table))
    rows = read_table(spark, table.target)
    latest = current_versions(keys, tombstones.select(*version_cols), rows.select(*version_cols))
    superseded = tombstones.join(latest, keys).where(
        newer(
            F.col("_cur_seq"),
            F.col("_cur_partition"),
            F.col("_cur_offset"),
            F.col("_src_seq"),
            F.col("_src_partition"),
            F.col("_src_offset"),
        )
    )
    identity = (*keys, "_src_topic", "_src_partition", "_src_offset")
    return delete_matching(spark, tombstone_target(table), superseded.select(*identity).distinct(), identity)


@dataclass(frozen=True)
class Tidied:
    """What maintenance dropped from one table's retained deletes."""

    superseded: int
    purged: int


def maintain(
    spark: SparkSession, cfg: ReplicaConfig, admin: TopicAdmin, now: datetime | None = None
) -> dict[str, Tidied]:
    """Compact every table's tombstone log, then purge what the retention rule allows."""
    superseded = {}
    for table in cfg.tables:
        superseded[table.name] = compact_tombstones(spark, table)
        logger.info(
            "replica %s table %s: dropped %d superseded retained deletes", cfg.name, table.name, superseded[table.name]
        )
    purged = purge_tombstones(spark, cfg, admin, now)
    return {name: Tidied(superseded[name], purged[name]) for name in superseded}
