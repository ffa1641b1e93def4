"""The foreachBatch handler: dedup -> decode -> order -> MERGE, exactly once per batch.

Per table, the retained tombstones are written before the replica table. If a crash lands between the two,
Spark re-runs the batch: Delta skips the write already committed (same ``txnAppId`` and batch id), and the
current state read for ordering ignores the tombstones that this very batch wrote, so the re-run decides exactly
what the first run decided.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_lib import decode
from replica_lib.config import CrashPoint, ReplicaConfig
from replica_lib.merge import Commit, append_quarantine, merge_rows, merge_tombstones
from replica_lib.ordering import current_versions, dedup, latest_per_key
from replica_lib.progress import batch_end_offsets, checkpoint_generation
from replica_lib.target import PROVENANCE_COLUMNS, TableSchema, read_table, tombstone_target

logger = logging.getLogger(__name__)

BatchHandler = Callable[[DataFrame, int], None]
STOP_MARKER = "replica stop requested"


class StopRequested(Exception):
    """Raised by the handler before any write once a stop was requested: the batch runs on the next start."""


@dataclass
class BatchStats:
    """What one micro-batch did, for the per-batch log line and for tests."""

    batch_id: int
    records: int = 0
    duplicates: int = 0
    upserts: int = 0
    deletes: int = 0
    quarantined: int = 0
    seconds: float = 0.0
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage of the batch, in order

    def line(self, replica: str) -> str:
        ends = " ".join(
            f"{t}:{','.join(f'{p}={o}' for p, o in sorted(parts.items()))}" for t, parts in sorted(self.offsets.items())
        )
        return (
            f"replica {replica} batch {self.batch_id}: {self.records} records in, {self.duplicates} duplicates "
            f"dropped, {self.upserts} upserts, {self.deletes} deletes, {self.quarantined} quarantined, "
            f"{self.seconds:.2f}s ({', '.join(f'{k} {v:.2f}s' for k, v in self.stages.items()) or '-'}), "
            f"offsets {ends or '-'}"
        )


def app_id(replica: str, table: str, generation: str) -> str:
    """Delta ``txnAppId`` for one table of one replica under one checkpoint generation."""
    return f"replica:{replica}:{table}:{generation}"


def quarantine_rows(rejected_df: DataFrame, replica: str, batch_id: int) -> DataFrame:
    """Rejected envelope or table rows in the quarantine table's shape."""
    return rejected_df.select(
        F.lit(replica).alias("replica"),
        F.lit(batch_id).cast("long").alias("batch_id"),
        F.col("_topic").alias("topic"),
        F.col("_partition").alias("partition"),
        F.col("_offset").alias("offset"),
        F.col("_kafka_ts").alias("kafka_timestamp"),
        F.col("_key").alias("key"),
        F.col("_value").alias("value"),
        F.col("_table").alias("table"),
        F.col("_error").alias("reason"),
        F.current_timestamp().alias("quarantined_at"),
    )


def make_batch_handler(
    cfg: ReplicaConfig,
    schemas: dict[str, TableSchema],
    on_batch: Callable[[BatchStats], None] | None = None,
    crash_at: CrashPoint | None = None,
    stop_requested: Callable[[], bool] | None = None,
) -> BatchHandler:
    """A ``foreachBatch`` function for ``cfg`` (closes over immutable config only).

    ``crash_at`` is for the fault harness: the process kills itself at that point of a batch.
    """
    generations: dict[str, str] = {}

    def crash(point: str, batch_id: int) -> None:
        if crash_at is None or crash_at.point != point:
            return
        if crash_at.batch_id is None or crash_at.batch_id == batch_id:
            logger.warning("replica %s batch %d: crashing at %s (REPLICA_CRASH_AT)", cfg.name, batch_id, point)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    def handle(batch_df: DataFrame, batch_id: int) -> None:
        if stop_requested is not None and stop_requested():
            raise StopRequested(f"{STOP_MARKER}: batch {batch_id} of replica {cfg.name} runs on the next start")
        started = time.monotonic()
        spark = batch_df.sparkSession
        if "id" not in generations:
            generations["id"] = checkpoint_generation(spark, cfg.checkpoint)
        generation = generations["id"]
        stats = BatchStats(batch_id=batch_id, offsets=batch_end_offsets(spark, cfg.checkpoint, batch_id))
        metadata = {
            "replica": cfg.name,
            "batch_id": batch_id,
            "generation": generation,
            "offsets": {t: {str(p): o for p, o in parts.items()} for t, parts in stats.offsets.items()},
        }

        crash("before_batch", batch_id)
        stage = _Stages(spark, stats, f"replica {cfg.name} batch {batch_id}")
        raw_df = batch_df.persist()
        try:
            with stage("read"):
                stats.records = raw_df.count()
            if stats.records == 0:
                stats.seconds = time.monotonic() - started
                logger.info(stats.line(cfg.name))
                return
            # Each stage is checkpointed locally: it truncates the plan, so later stages (and Delta's MERGE,
            # which plans its source several times) do not re-analyse the decoding expressions.
            with stage("decode"):
                env_df = decode.envelopes(dedup(raw_df), cfg, schemas).localCheckpoint()
                stats.duplicates = stats.records - env_df.count()
                changes = {
                    t.name: decode.table_changes(env_df, schemas[t.name]).localCheckpoint() for t in cfg.tables
                }
            with stage("quarantine"):
                rejected = [env_df.where(F.col("_error").isNotNull() & F.col("_table").isNull())]
                rejected += [decode.rejected(changes_df) for changes_df in changes.values()]
                quarantine_df = quarantine_rows(_union(rejected), cfg.name, batch_id).localCheckpoint()
                stats.quarantined = quarantine_df.count()
                if stats.quarantined:
                    quarantine_app = app_id(cfg.name, "_quarantine", generation)
                    append_quarantine(cfg.quarantine, quarantine_df, Commit(quarantine_app, batch_id, metadata))
            crash("after_quarantine", batch_id)
            for table in cfg.tables:
                schema, table_app = schemas[table.name], app_id(cfg.name, table.name, generation)
                with stage(f"{table.name}: order"):
                    winners_df = _winners(spark, decode.valid(changes[table.name]), schema, table_app, batch_id)
                    counts: dict[str, int] = {
                        row["_op"]: row["count"] for row in winners_df.groupBy("_op").count().collect()
                    }
                stats.upserts += counts.get("upsert", 0)
                stats.deletes += counts.get("delete", 0)
                tombstone_commit = Commit(f"{table_app}:tombstones", batch_id, metadata)
                with stage(f"{table.name}: tombstones"):
                    merge_tombstones(spark, tombstone_target(table), winners_df, schema, tombstone_commit)
                crash("after_tombstones", batch_id)
                with stage(f"{table.name}: merge"):
                    merge_rows(spark, table.target, winners_df, schema, Commit(table_app, batch_id, metadata))
            crash("after_commit", batch_id)
        finally:
            raw_df.unpersist()
        stats.seconds = time.monotonic() - started
        logger.info(stats.line(cfg.name))
        if on_batch is not None:
            on_batch(stats)

    return handle


class _Stages:
    """Times the stages of a batch into ``stats.stages`` and names their Spark jobs (Spark UI, event logs)."""

    def __init__(self, spark: SparkSession, stats: BatchStats, label: str) -> None:
        self.spark, self.stats, self.label = spark, stats, label

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        self.spark.sparkContext.setJobDescription(f"{self.label}: {name}")
        try:
            yield
        finally:
            self.spark.sparkContext.setJobDescription(None)  # type: ignore[arg-type]
            self.stats.stages[name] = self.stats.stages.get(name, 0.0) + time.monotonic() - started


def _union(frames: list[DataFrame]) -> DataFrame:
    columns = ["_topic", "_partition", "_offset", "_kafka_ts", "_key", "_value", "_table", "_error"]
    result = frames[0].select(*columns)
    for frame in frames[1:]:
        result = result.unionByName(frame.select(*columns))
    return result


def _winners(spark: object, valid_df: DataFrame, schema: TableSchema, table_app: str, batch_id: int) -> DataFrame:
    """The changes of this batch that win and are newer than the table's state, one per key (materialized)."""
    from pyspark.sql import SparkSession

    assert isinstance(spark, SparkSession)
    keys = schema.table.keys
    batch_keys = valid_df.select(*keys).distinct()
    version_cols = [*keys, *PROVENANCE_COLUMNS[1:4]]  # keys, _src_partition, _src_offset, _src_seq
    rows_state = read_table(spark, schema.table.target).join(batch_keys, list(keys), "left_semi")
    tombstones = read_table(spark, tombstone_target(schema.table))
    # A re-run of this batch must not see the tombstones its first run wrote (see the module docstring).
    tomb_state = tombstones.where(
        ~((F.col("_app_id") == F.lit(f"{table_app}:tombstones")) & (F.col("_batch_id") == batch_id))
    ).join(batch_keys, list(keys), "left_semi")
    current_df = current_versions(keys, rows_state.select(*version_cols), tomb_state.select(*version_cols))
    return latest_per_key(valid_df, keys, current_df).localCheckpoint()
