"""Replay quarantined records after a fix (of the config, the code or the producer), exactly once, in log order.

The unresolved records of the chosen tables are decoded again with the replica's current config and run through
the batch's own path as one batch (ordering per key by version, the gated MERGE, tombstones, held keys): a record
still rejected stays quarantined and keeps holding its key's later records; every other record is applied and
listed as replayed. A replay writes its commits under its own ``txnAppId`` with no offsets, so recovery and time
travel by offsets pass over them. Running it twice applies nothing twice: what the first run applied is resolved,
and if it was cut before that, the MERGE's version gate finds every change already there.

It runs with the replica stopped (it takes the checkpoint lock): the running replica keeps each table's retained
deletes in memory and would not see the deletes a replay applies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_lib.batch import BatchHandler
from replica_lib.config import ReplicaConfig
from replica_lib.progress import REPLAY_GENERATION
from replica_lib.quarantine import COORDINATES, REPLAYED, Reason, reasons, resolve, select, unresolved
from replica_lib.recovery import release_checkpoint, wait_until_stopped
from replica_lib.target import ensure_replica_tables

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replayed:
    """What a replay did: the records it took, those applied (and resolved), and why the rest stay."""

    records: int
    replayed: int
    upserted: int
    deleted: int
    still: tuple[Reason, ...]

    def line(self, replica: str) -> str:
        text = (
            f"replica {replica}: replayed {self.replayed} of {self.records} quarantined records "
            f"({self.upserted} rows upserted, {self.deleted} deleted)"
        )
        if self.still:
            text += f"; {self.records - self.replayed} stay quarantined: " + "; ".join(
                f"{r.reason} ({r.records} records)" for r in self.still
            )
        return text


def replay(
    spark: SparkSession, cfg: ReplicaConfig, tables: Sequence[str] = (), note: str = "", wait_s: float = 0.0
) -> Replayed:
    """Apply the unresolved quarantined records of ``tables`` (all if none) that decode now."""
    wait_until_stopped(cfg, wait_s, lambda: logger.info("replica %s is running: waiting for it to stop", cfg.name))
    try:
        return replay_locked(spark, cfg, tables, note)
    finally:
        release_checkpoint(cfg)


def replay_locked(
    spark: SparkSession, cfg: ReplicaConfig, tables: Sequence[str] = (), note: str = "", only: DataFrame | None = None
) -> Replayed:
    """:func:`replay`, by a caller that holds the replica's checkpoint lock already (a swap, for its rebuild);
    ``only``: of the records at these coordinates."""
    schemas = ensure_replica_tables(spark, cfg)
    found = unresolved(spark, cfg)
    if found is None:
        return Replayed(0, 0, 0, 0, ())
    if only is not None:
        found = found.join(only.select(*COORDINATES), COORDINATES, "left_semi")
    records = select(found, tables, ()).localCheckpoint()
    total = records.count()
    if not total:
        return Replayed(0, 0, 0, 0, ())
    raw_df = records.select(*COORDINATES, F.col("kafka_timestamp").alias("timestamp"), "key", "value")
    handler = BatchHandler(cfg, schemas, monitored=False, replay=True)
    try:
        stats = handler.apply(raw_df, int(time.time() * 1000), {}, REPLAY_GENERATION)
    finally:
        handler.close()
    again = handler.rejected_again
    done = records
    if again is not None:
        again_at = again.select(*[F.col(f"_{c}").alias(c) for c in COORDINATES])
        done = records.join(again_at, COORDINATES, "left_anti")
    done = done.localCheckpoint()
    replayed = done.count()
    resolve(spark, cfg, done, REPLAYED, note)
    still = tuple(_reasons(spark, cfg, tables)) if replayed < total else ()
    return Replayed(total, replayed, stats.upserts, stats.deletes, still)


def _reasons(spark: SparkSession, cfg: ReplicaConfig, tables: Sequence[str]) -> list[Reason]:
    return [r for r in reasons(spark, cfg) if not tables or set(r.tables) & set(tables)]
