"""Per-batch metrics: one JSON record per batch, to the log and optionally to a Delta table of its own.

A ``StreamingQueryListener`` joins what the handler counted of a batch (records, upserts, deletes, quarantined,
seconds per stage, end offsets) with Spark's progress report of the same batch (``min/avg/maxOffsetsBehindLatest``,
rates, the trigger's duration). Spark delivers progress events on its listener bus, after the batch, and the
Delta appends run on a thread of the listener's own: nothing here is on the batch's path. The record of a batch
re-run after a crash may appear twice in the metrics table (it is for monitoring; the replica's tables are exact).

Fields of a record (and columns of the table): ``replica``, ``query_id`` (the checkpoint's id), ``batch_id``,
``timestamp``, ``records``, ``upserts``, ``deletes``, ``quarantined``, ``unchanged`` (valid changes that changed no
row: a newer change of their key won, in the batch or in the table, or a delete found no row), ``seconds``,
``stages`` (seconds per stage), ``offsets`` (topic -> partition -> end offset), ``offsets_behind_min/avg/max``
(Spark's records between the batch's end and the log's end, per partition), ``input_rows_per_second``,
``processed_rows_per_second``, ``trigger_ms``, ``late`` (keys whose last change in the batch has a lower seq
than an earlier one: see ``replica_lib.ordering.one_per_key``) and ``late_tables`` (``late`` by table name, for the
tables that had any: what ``replica status`` and a rebuild's pre-flight add up), ``unknown_fields`` (records that
carried a field their table does not keep, by ``table.field``: see ``replica_lib.evolution``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from datetime import datetime
from typing import Any

from py4j.protocol import Py4JError
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.streaming import StreamingQueryListener

from replica_lib.batch import BatchStats
from replica_lib.config import ReplicaConfig
from replica_lib.errors import ReplicaError
from replica_lib.merge import Commit, append_metrics
from replica_lib.progress import offsets_json
from replica_lib.target import read_table, table_exists

logger = logging.getLogger(__name__)

#: The metrics table's columns.
METRICS_SCHEMA = T.StructType(
    [
        T.StructField("replica", T.StringType()),
        T.StructField("query_id", T.StringType()),
        T.StructField("batch_id", T.LongType()),
        T.StructField("timestamp", T.TimestampType()),
        T.StructField("records", T.LongType()),
        T.StructField("upserts", T.LongType()),
        T.StructField("deletes", T.LongType()),
        T.StructField("quarantined", T.LongType()),
        T.StructField("unchanged", T.LongType()),
        T.StructField("seconds", T.DoubleType()),
        T.StructField("stages", T.MapType(T.StringType(), T.DoubleType())),
        T.StructField("offsets", T.MapType(T.StringType(), T.MapType(T.IntegerType(), T.LongType()))),
        T.StructField("offsets_behind_min", T.DoubleType()),
        T.StructField("offsets_behind_avg", T.DoubleType()),
        T.StructField("offsets_behind_max", T.DoubleType()),
        T.StructField("input_rows_per_second", T.DoubleType()),
        T.StructField("processed_rows_per_second", T.DoubleType()),
        T.StructField("trigger_ms", T.LongType()),
        # Last: a table written before they existed gains them on append.
        T.StructField("late", T.LongType()),
        T.StructField("late_tables", T.MapType(T.StringType(), T.LongType())),
        T.StructField("unknown_fields", T.MapType(T.StringType(), T.LongType())),
    ]
)

#: Batches whose handler figures wait for Spark's progress report; older ones are dropped (a report never came).
_PENDING_MAX = 64
#: How long :meth:`BatchMetrics.close` waits for the last reports and appends.
CLOSE_TIMEOUT_S = 30.0


class BatchMetrics(StreamingQueryListener):
    """The listener of one replica's query (by name). :meth:`record` takes the handler's figures for a batch."""

    def __init__(self, spark: SparkSession, cfg: ReplicaConfig) -> None:
        self._session, self.cfg = spark, cfg
        self._cond = threading.Condition()
        self._stats: OrderedDict[int, BatchStats] = OrderedDict()
        self._unwritten: list[dict[str, Any]] = []
        self._writing = False
        self._closed = False
        self._writer: threading.Thread | None = None
        self._terminated: set[str] = set()  # run ids whose QueryTerminatedEvent reached this listener
        #: The batch id of the last record emitted (a long-running replica keeps no history of its own).
        self.last_emitted: int | None = None

    # ------------------------------------------------------------------------------------- handler side
    def record(self, stats: BatchStats) -> None:
        """The handler's figures for a finished batch (called at the end of the batch: a lock and an insert)."""
        with self._cond:
            self._stats[stats.batch_id] = stats
            while len(self._stats) > _PENDING_MAX:
                self._stats.popitem(last=False)

    # ------------------------------------------------------------------------------------- Spark's side
    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        with self._cond:
            self._terminated.add(str(event.runId))
            self._cond.notify_all()

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        if progress.name != self.cfg.name:
            return
        with self._cond:
            stats = self._stats.pop(progress.batchId, None)
        if stats is None:  # a trigger that ran no batch of ours (no new data)
            return
        try:
            record = metrics_record(self.cfg.name, stats, progress)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a report of another shape: never fail
            logger.warning("replica %s: no metrics for batch %s: %s", self.cfg.name, progress.batchId, exc)
            return
        logger.info("replica %s metrics %s", self.cfg.name, json.dumps(record, default=str, sort_keys=True))
        with self._cond:
            self.last_emitted = stats.batch_id
            if self.cfg.metrics is not None and not self._closed:
                self._unwritten.append(record)
                self._start_writer()
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------- waiting, closing
    def wait_for_batch(self, batch_id: int, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until the record of ``batch_id`` was emitted and appended; False after ``timeout_s``."""

        def done() -> bool:
            seen = self.last_emitted is not None and self.last_emitted >= batch_id
            return seen and not self._unwritten and not self._writing

        with self._cond:
            return self._cond.wait_for(done, timeout_s)

    def close(self, last_batch: int | None, run_id: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Wait (bounded) for the report of ``last_batch``, the last appends and the end of run ``run_id``.

        Spark posts a stopped query's last events asynchronously; a listener removed while one is on its way is
        still called, and a call into a Python process that is exiting is logged by Spark as an ERROR. So the
        listener leaves only once the query's termination event reached it and Spark's listener bus is empty.
        """
        if last_batch is not None and not self.wait_for_batch(last_batch, timeout_s):
            logger.warning("replica %s: the metrics of batch %s were not all written", self.cfg.name, last_batch)
        with self._cond:
            self._closed = True
            if not self._cond.wait_for(lambda: run_id in self._terminated, timeout_s):
                logger.warning("replica %s: Spark did not report the end of run %s", self.cfg.name, run_id)
        self._session.streams.removeListener(self)
        bus = self._session.sparkContext._jsc.sc().listenerBus()
        try:
            bus.waitUntilEmpty(int(timeout_s * 1000))
        except Py4JError as exc:  # a timeout: other listeners are slow; ours was removed already
            logger.debug("replica %s: Spark's listener bus still busy at close: %s", self.cfg.name, exc)

    def _start_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name=f"replica-{self.cfg.name}-metrics")
            self._writer.daemon = True
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                if not self._unwritten:
                    return
                rows, self._unwritten = self._unwritten, []
                self._writing = True
            try:
                assert self.cfg.metrics is not None
                # Idempotent per checkpoint (the query id is the checkpoint's): a batch re-run after a crash is not
                # appended again if the append that held it committed.
                last = max(int(r["batch_id"]) for r in rows)
                commit = Commit(
                    f"replica:{self.cfg.name}:metrics:{rows[-1]['query_id']}", last, {"replica": self.cfg.name}
                )
                append_metrics(self._session, self.cfg.metrics, [_row(r) for r in rows], METRICS_SCHEMA, commit)
            except (Py4JError, PySparkException, ReplicaError) as exc:  # monitoring never stops the replica
                logger.warning("replica %s: could not append %d metrics records: %s", self.cfg.name, len(rows), exc)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()


def metrics_record(replica: str, stats: BatchStats, progress: Any) -> dict[str, Any]:
    """One batch's record: the handler's figures and Spark's progress report of the same batch."""
    behind = _offsets_behind(progress)
    return {
        "replica": replica,
        "query_id": str(progress.id),
        "batch_id": stats.batch_id,
        "timestamp": progress.timestamp,
        "records": stats.records,
        "upserts": stats.upserts,
        "deletes": stats.deletes,
        "quarantined": stats.quarantined,
        "unchanged": max(0, stats.records - stats.quarantined - stats.upserts - stats.deletes),
        "seconds": round(stats.seconds, 3),
        "stages": {name: round(seconds, 3) for name, seconds in stats.stages.items()},
        "offsets": offsets_json(stats.offsets),
        "offsets_behind_min": behind[0],
        "offsets_behind_avg": behind[1],
        "offsets_behind_max": behind[2],
        "input_rows_per_second": _finite(progress.inputRowsPerSecond),
        "processed_rows_per_second": _finite(progress.processedRowsPerSecond),
        "trigger_ms": progress.durationMs.get("triggerExecution"),
        "late": stats.late,
        "late_tables": dict(stats.late_tables),
        "unknown_fields": dict(stats.unknown_fields),
    }


def _offsets_behind(progress: Any) -> tuple[float | None, float | None, float | None]:
    """Spark's ``min/avg/maxOffsetsBehindLatest`` of the Kafka source (None before Spark knows the log's end)."""
    for source in progress.sources:
        metrics = source.metrics or {}
        if "maxOffsetsBehindLatest" in metrics:
            return tuple(_finite(metrics.get(f"{k}OffsetsBehindLatest")) for k in ("min", "avg", "max"))  # type: ignore[return-value]
    return None, None, None


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if number == number and abs(number) != float("inf") else None


def _row(record: dict[str, Any]) -> tuple[Any, ...]:
    values = dict(record)
    values["timestamp"] = datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00"))
    values["offsets"] = {t: {int(p): o for p, o in parts.items()} for t, parts in record["offsets"].items()}
    return tuple(values[f.name] for f in METRICS_SCHEMA.fields)


def late_counts(spark: SparkSession, cfg: ReplicaConfig) -> dict[str, int] | None:
    """Late changes the replica has counted, by table, from its metrics table (None when it keeps none).

    Each batch counts once, however often its record was appended (a batch re-run after a crash). A metrics table
    from before ``late_tables`` existed counts from when it gained the column.
    """
    sums = _map_sums(spark, cfg, "late_tables")
    if sums is None:
        return None
    counts = {t.name: 0 for t in cfg.tables}
    counts.update({name: n for name, n in sums.items() if name in counts})
    return counts


def unknown_field_counts(spark: SparkSession, cfg: ReplicaConfig) -> dict[str, dict[str, int]] | None:
    """Records that carried a field their table does not keep, by table and field, from the metrics table (None
    when it keeps none); counted as :func:`late_counts` counts."""
    sums = _map_sums(spark, cfg, "unknown_fields")
    if sums is None:
        return None
    counts: dict[str, dict[str, int]] = {t.name: {} for t in cfg.tables}
    for name, n in sums.items():
        table, _, column = name.partition(".")
        if table in counts:
            counts[table][column] = n
    return counts


def _map_sums(spark: SparkSession, cfg: ReplicaConfig, column: str) -> dict[str, int] | None:
    """The sums per key of a map column of the replica's metrics records, each batch once."""
    if cfg.metrics is None or not table_exists(spark, cfg.metrics):
        return None
    metrics_df = read_table(spark, cfg.metrics)
    if column not in metrics_df.columns:
        return {}
    rows = (
        metrics_df.where(F.col("replica") == cfg.name)
        .select("query_id", "batch_id", F.explode(column).alias("name", "n"))
        .dropDuplicates(["query_id", "batch_id", "name"])
        .groupBy("name")
        .agg(F.sum("n").alias("n"))
        .collect()
    )
    return {str(row["name"]): int(row["n"]) for row in rows}
