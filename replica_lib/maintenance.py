"""Keeping a replica tidy: purging retained deletes once that can no longer let a deleted key come back.

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
from datetime import UTC, datetime, timedelta

from pyspark.sql import SparkSession

from replica_lib.config import ReplicaConfig
from replica_lib.merge import delete_where
from replica_lib.target import tombstone_target
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
