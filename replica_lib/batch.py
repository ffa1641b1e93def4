"""The foreachBatch handler: decode -> order (and dedup) -> MERGE, exactly once per batch.

Per table, the batch's winning deletes are appended to the tombstone table and the replica table is merged. If
a crash lands between the two commits, Spark re-runs the batch: Delta skips the write already committed (same
``txnAppId`` and batch id), and the current state read for ordering ignores the tombstones that this very batch
wrote, so the re-run decides exactly what the first run decided. Only Kafka tombstones read the replica table's
rows (they take the seq of the state they delete), so a batch holding some appends its tombstones first; any
other batch makes the two writes at once, as the winners do not depend on which of them committed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.util import inheritable_thread_target

from replica_lib import decode
from replica_lib.config import CrashPoint, ReplicaConfig, Target
from replica_lib.merge import (
    BROADCAST_ROWS,
    Commit,
    KeyRange,
    append_quarantine,
    append_rows,
    append_tombstones,
    compact_files,
    delta_table,
    merge_rows,
)
from replica_lib.ordering import current_versions, latest_per_key
from replica_lib.progress import batch_end_offsets, checkpoint_generation
from replica_lib.target import TableSchema, read_table, tombstone_target, version_columns

logger = logging.getLogger(__name__)

BatchHandler = Callable[[DataFrame, int], None]
#: Threads for the writes that run beside a batch's MERGE, shared by the replicas of the process: a handler waits
#: for its own before it returns, so a batch never leaves a write behind.
_BESIDE = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="replica-beside")
STOP_MARKER = "replica stop requested"


class StopRequested(Exception):
    """Raised by the handler before any write once a stop was requested: the batch runs on the next start."""


@dataclass
class BatchStats:
    """What one micro-batch did, for the per-batch log line and for tests."""

    batch_id: int
    records: int = 0
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
            f"replica {replica} batch {self.batch_id}: {self.records} records in, {self.upserts} upserts, "
            f"{self.deletes} deletes, {self.quarantined} quarantined, "
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
    filled: set[str] = set()  # tables known to hold data: they never need the emptiness check again
    retained = _Retained()

    def empty(spark: SparkSession, target: Target) -> bool:
        if target.describe() in filled:
            return False
        if is_empty(spark, target):
            return True
        filled.add(target.describe())
        return False

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
        # Each stage is checkpointed locally: it truncates the plan, so later stages (and Delta's MERGE, which
        # plans its source several times) do not re-analyse the decoding expressions; the batch's records are read
        # from Kafka once, by the decode.
        with stage("decode"):
            env_df = decode.envelopes(batch_df, cfg, schemas)
            if len(cfg.tables) > 1:
                env_df = env_df.persist()  # each table's changes are read from it
            # The first table's changes also hold the envelopes routed to no table (rejected).
            alone = len(cfg.tables) == 1
            changes, observed = {}, {}
            for i, t in enumerate(cfg.tables):
                changes_df = decode.table_changes(env_df, schemas[t.name], unrouted=i == 0, alone=alone)
                changes[t.name], observed[t.name] = _observed(changes_df, schemas[t.name])
            env_df.unpersist()
            counts = _summaries(observed, schemas)
            stats.records = counts["envelopes"]
        if stats.records == 0:
            stats.seconds = time.monotonic() - started
            logger.info(stats.line(cfg.name))
            return
        _size_for(spark, stats.records)
        with stage("quarantine"):
            stats.quarantined = counts["rejected"]
            if stats.quarantined:
                rejected = _union([decode.rejected(changes_df) for changes_df in changes.values()])
                quarantine_app = app_id(cfg.name, "_quarantine", generation)
                quarantine_df = quarantine_rows(rejected.dropDuplicates(_COORDINATES), cfg.name, batch_id)
                append_quarantine(cfg.quarantine, quarantine_df, Commit(quarantine_app, batch_id, metadata))
        crash("after_quarantine", batch_id)
        for table in cfg.tables:
            schema, table_app = schemas[table.name], app_id(cfg.name, table.name, generation)
            rows_target = table.target
            with stage(f"{table.name}: order"):
                rows_empty = empty(spark, rows_target)
                deletes = retained.of(spark, schema, table_app, batch_id)
                winners = _winners(spark, changes[table.name], counts[table.name], schema, deletes, rows_empty)
            if winners is None:
                continue
            tombstones = functools.partial(
                _append_tombstones,
                stage,
                table.name,
                tombstone_target(table),
                winners,
                schema,
                Commit(f"{table_app}:tombstones", batch_id, metadata),
                functools.partial(crash, "after_tombstones", batch_id),
            )
            beside = None
            if winners.deletes and not counts[table.name].tombstones:
                # Beside the MERGE: without Kafka tombstones, a re-run decides the same winners whichever of
                # the two writes committed (module docstring).
                beside = _BESIDE.submit(inheritable_thread_target(spark)(tombstones))
            else:
                tombstones()
            try:
                with stage(f"{table.name}: merge"):
                    table_commit = Commit(table_app, batch_id, metadata)
                    if rows_empty:
                        applied = append_rows(rows_target, winners.df, schema, table_commit)
                    else:
                        applied = merge_rows(
                            spark, rows_target, winners.df, schema, table_commit, winners.rows, winners.key_range
                        )
            finally:
                if beside is not None:
                    futures.wait([beside])
            if beside is not None:
                beside.result()
            if winners.deletes:
                retained.add(table.name, winners.df, schema)
            stats.upserts += applied.upserted
            stats.deletes += winners.count_deletes() if rows_empty else applied.deleted
        crash("after_commit", batch_id)
        every = cfg.compaction.every_batches
        if every and (batch_id + 1) % every == 0:
            with stage("compact"):
                _compact(spark, cfg, f"replica {cfg.name} batch {batch_id}")
            crash("after_compaction", batch_id)
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


def _compact(spark: SparkSession, cfg: ReplicaConfig, label: str) -> None:
    """Pack the small files of the replica's tables, between two batches: no MERGE of its own can conflict.

    By batch id, so a replica run in short ``--available-now`` runs compacts as often as a long-running one.
    """
    targets = [t for table in cfg.tables for t in (table.target, tombstone_target(table))] + [cfg.quarantine]
    done = []
    for target in targets:
        compacted = compact_files(spark, target, cfg.compaction.small_file_mb << 20)
        if compacted is not None and compacted.removed:
            done.append(f"{target.describe()} {compacted.removed} files into {compacted.added}")
    logger.info("%s: compacted %s", label, ", ".join(done) or "nothing (no small files)")


def _append_tombstones(
    stage: _Stages,
    name: str,
    target: Target,
    winners: _Winners,
    schema: TableSchema,
    commit: Commit,
    then: Callable[[], None],
) -> None:
    """Append the batch's winning deletes to the table's tombstone log (an append: see :func:`_winners`)."""
    with stage(f"{name}: tombstones"):
        if winners.deletes:
            append_tombstones(target, winners.df, schema, commit)
    then()


_COORDINATES = ["_topic", "_partition", "_offset"]  # a record's place in the log: copies of a record share it


def _union(frames: list[DataFrame]) -> DataFrame:
    columns = [*_COORDINATES, "_kafka_ts", "_key", "_value", "_table", "_error"]
    result = frames[0].select(*columns)
    for frame in frames[1:]:
        result = result.unionByName(frame.select(*columns))
    return result


# Key types whose min/max Delta keeps as file statistics (so a key range can skip files).
_RANGE_TYPES = (T.NumericType, T.StringType, T.DateType, T.TimestampType)


@dataclass(frozen=True)
class _Winners:
    """A table's winning changes of one batch (materialized), with what the writes need to know about them."""

    df: DataFrame
    rows: int  # at most this many winners (the batch's valid changes)
    deletes: int  # at most this many winning deletes (the batch's valid deletes)
    key_range: KeyRange | None

    def count_deletes(self) -> int:
        """The winning deletes, counted (a Spark job: only where a figure must be exact)."""
        return self.df.where(F.col("_op") == "delete").count() if self.deletes else 0


#: Records per partition of a batch: small batches run in one partition, as most of their cost is per task.
RECORDS_PER_PARTITION = 10_000


BATCH_SIZING = "spark.replica.batchSizing"


def _size_for(spark: SparkSession, records: int) -> None:
    """Size the batch's shuffles to its records (unless ``spark.replica.batchSizing=off``).

    A Spark job costs ~20 ms per task on top of its work; a micro-batch runs ~18 jobs, so a 1,000-record batch
    spread over 4 partitions spends most of its time scheduling tasks. Adaptive execution stays off: it plans
    more per job, and it coalesced a 200,000-record rebuild batch into one partition (decoding on one core:
    8.7 s instead of 3.4 s).
    """
    if spark.conf.get(BATCH_SIZING, "auto") == "off":
        return
    cores = max(1, spark.sparkContext.defaultParallelism)
    partitions = min(cores, max(1, records // RECORDS_PER_PARTITION))
    spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    spark.conf.set("spark.sql.adaptive.enabled", "false")


@dataclass(frozen=True)
class _Summary:
    """One table's changes in a batch, counted while they are decoded: what the later stages decide on."""

    valid: int
    rejected: int
    deletes: int
    tombstones: int  # Kafka tombstones (null values) among the valid deletes
    keys: tuple[Column, Column]  # smallest and greatest first key column among the valid changes (literals)
    tombstone_keys: tuple[Column, Column]  # the same among the Kafka tombstones
    records: int  # every change, valid or rejected


def _observed(changes_df: DataFrame, schema: TableSchema) -> tuple[DataFrame, Observation]:
    """Materialize a table's changes (a local checkpoint) and count them in the same job (an observation).

    The key bounds are observed as strings, which the summary casts back: an observation hands over dates,
    timestamps and decimals as Java objects, and the cast round trip is exact for every type of
    :data:`_RANGE_TYPES`.
    """
    ok, is_delete = F.col("_error").isNull(), F.col("_op") == "delete"
    key = F.col(f"`{schema.table.keys[0]}`")
    observation = Observation()
    observed = changes_df.observe(
        observation,
        F.count(F.when(ok, 1)).alias("valid"),
        F.count(F.col("_error")).alias("rejected"),
        F.count(F.when(ok & is_delete, 1)).alias("deletes"),
        F.count(F.when(ok & F.col("_tombstone"), 1)).alias("tombstones"),
        F.min(F.when(ok, key)).cast("string").alias("low"),
        F.max(F.when(ok, key)).cast("string").alias("high"),
        F.min(F.when(ok & F.col("_tombstone"), key)).cast("string").alias("tombstone_low"),
        F.max(F.when(ok & F.col("_tombstone"), key)).cast("string").alias("tombstone_high"),
        F.count(F.lit(1)).alias("records"),
    )
    return observed.localCheckpoint(), observation


def _summaries(observed: dict[str, Observation], schemas: dict[str, TableSchema]) -> dict[str, Any]:
    """Envelopes and rejected records of the batch, and a :class:`_Summary` per table (from the decode's job)."""
    result: dict[str, Any] = {"envelopes": 0, "rejected": 0}
    for name, observation in observed.items():
        row = observation.get
        key_type = schemas[name].key_schema.fields[0].dataType
        summary = _Summary(
            int(row["valid"]),
            int(row["rejected"]),
            int(row["deletes"]),
            int(row["tombstones"]),
            (F.lit(row["low"]).cast(key_type), F.lit(row["high"]).cast(key_type)),
            (F.lit(row["tombstone_low"]).cast(key_type), F.lit(row["tombstone_high"]).cast(key_type)),
            int(row["records"]),
        )
        result[name] = summary
        result["envelopes"] += summary.records
        result["rejected"] += summary.rejected
    return result


def is_empty(spark: SparkSession, target: Target) -> bool:
    """Whether a Delta table has no data files (a replica being rebuilt); reads only the table's log."""
    row = delta_table(spark, target).detail().select("numFiles").first()
    return row is None or not row[0]


class _Retained:
    """Each table's retained deletes (keys and versions): read from Delta once, then kept up to date in memory.

    The replica is the only writer that adds to its tombstone tables, so after the first read the deletes of its
    own batches are all that is new; reading the table every batch would cost a Delta snapshot and file listing
    (~0.5 s). Maintenance only drops deletes that no longer count, which do no harm here until the next start.
    A batch's deletes join the state once their append is committed; every ``COMPACT_EVERY`` batches the state is
    materialized again as one frame.
    """

    COMPACT_EVERY = 16

    def __init__(self) -> None:
        self.parts: dict[str, list[DataFrame]] = {}

    def of(self, spark: SparkSession, schema: TableSchema, table_app: str, batch_id: int) -> DataFrame:
        """The table's retained deletes as ``keys + _src_partition, _src_offset, _src_seq``."""
        name = schema.table.name
        if name not in self.parts:
            # A re-run of this batch must not see the tombstones its first run wrote (see the module docstring).
            own = (F.col("_app_id") == F.lit(f"{table_app}:tombstones")) & (F.col("_batch_id") == batch_id)
            tombstones = read_table(spark, tombstone_target(schema.table)).where(~own)
            self.parts[name] = [tombstones.select(*version_columns(schema.table.keys)).localCheckpoint()]
        return reduce(DataFrame.unionByName, self.parts[name])

    def add(self, name: str, winners_df: DataFrame, schema: TableSchema) -> None:
        """Add the winning deletes of a batch whose tombstones are committed."""
        keys = [F.col(f"`{k}`") for k in schema.table.keys]
        deletes = winners_df.where(F.col("_op") == "delete").select(
            *keys,
            F.col("_partition").alias("_src_partition"),
            F.col("_offset").alias("_src_offset"),
            F.col("_seq").alias("_src_seq"),
        )
        parts = self.parts[name]
        parts.append(deletes)
        if len(parts) > self.COMPACT_EVERY:
            self.parts[name] = [reduce(DataFrame.unionByName, parts).localCheckpoint()]


def _winners(
    spark: SparkSession,
    changes_df: DataFrame,
    summary: _Summary,
    schema: TableSchema,
    retained_df: DataFrame,
    rows_empty: bool,
) -> _Winners | None:
    """The changes of this batch that win and are newer than what the tables hold, one per key; None if none.

    Changes are checked here against the retained deletes only (``retained_df``, see :class:`_Retained`); the
    MERGE checks them against the replica table's rows. The rows are read only for the keys of Kafka
    tombstones, which take the seq of the state they delete (the files in their key range, when data skipping
    allows).

    The tombstone table is a log: a key may have several retained deletes, and one older than its live row (a
    delete that lost to the row, or a key upserted again since). That is harmless: what any change is checked
    against is the greatest version among a key's row and retained deletes. ``jobs/maintain.py`` drops the
    superseded ones (:func:`replica_lib.maintenance.compact_tombstones`).
    """
    keys = list(schema.table.keys)
    version_cols = version_columns(schema.table.keys)
    valid_df = decode.valid(changes_df)
    key = F.col(f"`{keys[0]}`")
    rows = summary.valid
    if rows == 0:
        return None
    ranged = len(keys) == 1 and isinstance(schema.key_schema.fields[0].dataType, _RANGE_TYPES)
    key_range = KeyRange(keys[0], *summary.keys) if ranged else None
    batch_keys = valid_df.select(*keys).distinct()
    if rows <= BROADCAST_ROWS:
        batch_keys = F.broadcast(batch_keys)
    states = [retained_df.join(batch_keys, keys, "left_semi")]
    if summary.tombstones and not rows_empty:
        rows_df = read_table(spark, schema.table.target)
        if ranged:
            rows_df = rows_df.where(key.between(*summary.tombstone_keys))
        tombstone_keys = valid_df.where(F.col("_tombstone")).select(*keys).distinct()
        states.append(rows_df.join(F.broadcast(tombstone_keys), keys, "left_semi").select(*version_cols))
    winners_df = latest_per_key(valid_df, keys, current_versions(keys, *states))
    return _Winners(winners_df.localCheckpoint(), rows, summary.deletes, key_range)
