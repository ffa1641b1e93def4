"""The benchmark: the materializer side by side with the ceiling, the naive pattern and a peer, in one run.

Every contender reads the same seeded records from the same broker in the same SparkSession, one after the
other, each with its own checkpoint and table, so the figures are comparable as ratios:

- **ceiling**: Spark's kafka source appending the records to a Delta table (no decoding, no MERGE);
- **naive**: ``foreachBatch`` + one plain Delta MERGE per batch after a per-key dedup (Delta's documented
  upsert pattern: no version gating, no tombstones, no pruning), and its rebuild (its decode and dedup over the
  whole log in one batch, the upserts appended: the floor under ours, as it checks nothing);
- **peer**: kafka2delta (PyPI), when it can run here (see :mod:`replica_dev.bench_peer`);
- **ours**: the materializer (:func:`replica_lib.stream.start_replica`), and its rebuild
  (:func:`replica_lib.rebuild.rebuild`: the whole log in one batch into empty tables);
- **ours-mor**: the materializer with the table's layout merge-on-read: each batch appends to a change log, and
  a fold every ``fold_every_batches`` batches merges it into the table (:mod:`replica_lib.layout`).

Measured: events/s to catch up a full backlog, p50/p99 batch time, p50/p99 freshness (produce -> committed)
at a fixed produce rate into a pre-filled table, batch time as the table grows, and what a reader of our tables
pays after the catch-up (merge-on-read: with the changes pending, then folded).
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import statistics
import string
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.streaming.query import StreamingQuery

from replica_dev.conf import orders_table, replica_doc
from replica_dev.cpuprofile import Recorder, read, table
from replica_dev.loadgen import CUSTOMERS, STATUSES
from replica_dev.naive import merge_naive
from replica_lib.batch import BatchHooks, BatchStats
from replica_lib.config import (
    COPY_ON_WRITE,
    FETCH_MAX_WAIT_MS,
    MERGE_ON_READ,
    ReplicaConfig,
    TableConfig,
    parse_replica,
)
from replica_lib.errors import ConfigError
from replica_lib.layout import fold, read_state
from replica_lib.producer import Change, ChangeProducer, ProducerSettings, encode_key, encode_value
from replica_lib.rebuild import rebuild, rebuild_config
from replica_lib.stream import start_replica
from replica_lib.target import changes_target, ensure_replica_tables, read_table, table_schema
from replica_lib.topics import TopicAdmin, TopicSpec

logger = logging.getLogger(__name__)

BENCH_SCHEMA = "order_id BIGINT, customer STRING, amount DOUBLE, status STRING, updated_ms BIGINT, note STRING"
DATA_COLUMNS = ("order_id", "customer", "amount", "status", "updated_ms", "note")
FLOOR_ROWS = 100_000
CONTENDERS = ("ceiling", "naive", "peer", "ours", "ours-mor")
#: The one-batch runs of the whole backlog: the ceiling's, our rebuild and the naive pattern's (its floor); plotted
#: apart from the streaming contenders.
ONE_BATCH = ("ceiling_bulk", "rebuild", "naive_bulk")
#: Our contenders, by the layout of their table: both run through the same path, only the layout differs.
OURS = {"ours": COPY_ON_WRITE, "ours-mor": MERGE_ON_READ}
REPEATS = 5
#: How the growth phase picks keys: uniformly over the table (every file touched), or among the newest keys.
GROWTH_KEYS = ("uniform", "recent")
#: The growth phase's contenders and the report entry of each.
GROWTH_REPORTS = {"ours": "growth", "ours-mor": "growth_mor"}
RECENT_KEYS = 100_000
ROWS_PER_FILE = 250_000  # the prefill's file size, ~40 MB: range-partitioned by key, as OPTIMIZE would leave it


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class BenchPlan:
    """What to run. Catch-up: ``events`` changes over ``keys`` keys, read ``batch_size`` records per batch."""

    keys: int = 100_000
    events: int = 200_000
    delete_share: float = 0.05
    value_bytes: int = 100
    batch_size: int = 20_000
    partitions: int = 4
    seed: int = 11
    contenders: tuple[str, ...] = CONTENDERS
    fresh_rate: int = 1_000
    fresh_seconds: int = 30
    #: The contenders of the freshness phase (empty: every contender of the plan).
    fresh_contenders: tuple[str, ...] = ()
    fresh_rows: int = 1_000_000
    growth_rows: tuple[int, ...] = (100_000, 1_000_000, 10_000_000)
    #: Which key draws the growth phase runs (:data:`GROWTH_KEYS`): every file touched, or the newest keys'.
    growth_keys: tuple[str, ...] = GROWTH_KEYS
    growth_batch_size: int = 1_000
    growth_batches: int = 6
    #: Not measured, run by every contender before the catch-up: several full-size batches, as Spark's query
    #: planning and Delta's commit path (most of a small batch's time) run slowly until the JIT has compiled them.
    warmup_events: int = 60_000
    #: ours-mor: the stream folds the change log into the table after every this-many-th batch (0: never).
    fold_every_batches: int = 10
    #: The measured runs (after one unmeasured) of each fixed-cost action and reader query: the median is reported.
    repeats: int = REPEATS
    #: Rounds: the catch-up (every contender, and the rebuild) and the freshness phase each run this many times,
    #: one round after the other; each of their ratios is the median of the rounds' own, so it is not one sample.
    rounds: int = 1
    #: Record each catch-up and one-batch run in a JVM flight recording and report where its CPU went, per 1,000
    #: changes and kind of work (:mod:`replica_dev.cpuprofile`). Execution samples only, every 10 ms: a profiled
    #: run's rates were within the run-to-run spread of an unprofiled one's.
    profile: bool = False

    def __post_init__(self) -> None:
        def fail(name: str, problem: str, fix: str) -> None:
            raise ConfigError("bench arguments", name, problem, fix)

        for name in (
            "keys",
            "events",
            "batch_size",
            "partitions",
            "growth_batch_size",
            "growth_batches",
            "repeats",
            "rounds",
        ):
            if getattr(self, name) < 1:
                fail(f"--{name.replace('_', '-')}", f"must be at least 1, got {getattr(self, name)}", "pass 1 or more")
        for name in ("fresh_rate", "fresh_seconds", "fresh_rows", "warmup_events", "value_bytes"):
            if getattr(self, name) < 0:
                fail(f"--{name.replace('_', '-')}", "must not be negative", "pass 0 to skip that part")
        if self.fold_every_batches < 0:
            fail("--fold-every-batches", "must not be negative", "pass 0 to leave the change log unfolded")
        if not 0 <= self.delete_share < 1:
            fail("--delete-share", f"{self.delete_share} is not in [0, 1)", "e.g. --delete-share 0.05")
        unknown = [c for c in self.contenders if c not in CONTENDERS]
        if unknown or not self.contenders:
            fail("--contenders", f"unknown {unknown}" if unknown else "none given", f"use {','.join(CONTENDERS)}")
        stray = [c for c in self.fresh_contenders if c not in self.contenders]
        if stray:
            fail("--fresh-contenders", f"{stray} not among --contenders", f"use any of {','.join(self.contenders)}")
        unknown_keys = [keys for keys in self.growth_keys if keys not in GROWTH_KEYS]
        if unknown_keys or not self.growth_keys:
            problem = f"unknown {unknown_keys}" if unknown_keys else "none given"
            fail("--growth-keys", problem, f"use any of {','.join(GROWTH_KEYS)}")
        if any(rows < 1 for rows in self.growth_rows):
            fail("--growth-rows", "table sizes must be positive", "e.g. --growth-rows 100000,1000000")


# ---------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Event:
    """One change of the benchmark workload, in a form every contender's encoder takes."""

    key: int
    op: str  # "upsert" or "delete"
    seq: int
    ts_ms: int
    row: dict[str, Any] | None


def workload(
    keys: int,
    events: int,
    delete_share: float,
    value_bytes: int,
    seed: int,
    prefilled: bool = False,
    first_key: int = 0,
) -> list[Event]:
    """Seeded changes over keys ``first_key..keys-1`` chosen uniformly; each key's seq counts its changes from 1.

    A key's first change is an insert, later ones updates, ``delete_share`` of the changes of live keys deletes.
    ``prefilled``: every key is live from the start (a table filled beforehand with seq 0); seqs then start at 2.
    """
    rng = random.Random(seed)
    pool = ["".join(rng.choices(string.ascii_letters, k=value_bytes)) for _ in range(64)]
    seqs: dict[int, int] = {}
    live: set[int] = set()
    now_ms = 1_700_000_000_000
    out = []
    gone: set[int] = set()  # prefilled: the keys deleted so far (all others are live)
    for _ in range(events):
        now_ms += 1
        key = rng.randrange(first_key, keys)
        seq = seqs.get(key, 1 if prefilled else 0) + 1
        seqs[key] = seq
        is_live = key not in gone if prefilled else key in live
        if is_live and rng.random() < delete_share:
            live.discard(key)
            gone.add(key)
            out.append(Event(key, "delete", seq, now_ms, None))
            continue
        live.add(key)
        gone.discard(key)
        row = {
            "order_id": key,
            "customer": CUSTOMERS[key % len(CUSTOMERS)],
            "amount": round(rng.uniform(5, 500), 2),
            "status": STATUSES[min(seq - 1, len(STATUSES) - 1)],
            "updated_ms": now_ms,
            "note": pool[rng.randrange(len(pool))],
        }
        out.append(Event(key, "upsert", seq, now_ms, row))
    return out


Encoder = Callable[[Event], tuple[bytes, bytes | None]]


def native_record(event: Event) -> tuple[bytes, bytes | None]:
    """The event as a Kafka record of the project's change-event contract (docs/design.md §3): key and value bytes."""
    change = Change(key={"order_id": event.key}, op=event.op, data=event.row, seq=event.seq, ts_ms=event.ts_ms)  # type: ignore[arg-type]
    return encode_key(change.key), encode_value(change)


# ---------------------------------------------------------------------------------------------- results
@dataclass
class Run:
    """One streaming run of one contender: its batches (from Spark's progress reports) and wall time."""

    contender: str
    records: int = 0
    seconds: float = 0.0
    batches: list[dict[str, Any]] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # ours, ours-mor: median seconds per stage of a batch
    #: After the last batch, how long the stop took: for ours-mor, the wait for a fold still running beside them.
    stop_s: float = 0.0

    @property
    def events_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    def batch_seconds(self) -> list[float]:
        return [b["seconds"] for b in self.batches if b["rows"] > 0]

    def summary(self) -> dict[str, Any]:
        times = self.batch_seconds()
        return {
            "records": self.records,
            "seconds": round(self.seconds, 2),
            "events_per_s": round(self.events_per_s, 1),
            "batches": len(times),
            "batch_p50_s": _round(percentile(times, 50)),
            "batch_p99_s": _round(percentile(times, 99)),
            **({"stages_p50_s": self.stages} if self.stages else {}),
            "stop_s": round(self.stop_s, 2),
        }


def stage_medians(batches: Sequence[BatchStats]) -> dict[str, float]:
    """Median seconds of each stage over the batches that ran it: where a batch of ours spends its time."""
    names = list(dict.fromkeys(name for stats in batches for name in stats.stages))
    medians = {}
    for name in names:
        value = percentile([stats.stages[name] for stats in batches if name in stats.stages], 50)
        if value is not None:
            medians[name] = round(value, 3)
    return medians


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def progress_batches(query: StreamingQuery) -> list[dict[str, Any]]:
    """Each batch of a (stopped) query: id, input rows, start/end wall time, seconds, end offsets per partition."""
    batches = []
    for progress in query.recentProgress:
        p = progress if isinstance(progress, dict) else json.loads(progress.json)
        if p.get("numInputRows", 0) == 0 and "addBatch" not in p.get("durationMs", {}):
            continue
        start = datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()
        seconds = p["durationMs"].get("triggerExecution", 0) / 1000
        ends: dict[tuple[str, int], int] = {}
        for source in p["sources"]:
            end = source.get("endOffset")
            end = json.loads(end) if isinstance(end, str) else end
            for topic, parts in (end or {}).items():
                for part, offset in parts.items():
                    ends[(topic, int(part))] = int(offset)
        batches.append(
            {
                "batch_id": p["batchId"],
                "rows": p["numInputRows"],
                "start": start,
                "end": start + seconds,
                "seconds": seconds,
                "ends": ends,
            }
        )
    return batches


# ---------------------------------------------------------------------------------------------- the bench
class Bench:
    """Runs a :class:`BenchPlan` against one broker and one SparkSession, under ``workdir``."""

    def __init__(self, spark: SparkSession, plan: BenchPlan, workdir: Path, bootstrap_servers: str) -> None:
        self.spark = spark
        self.plan = plan
        self.workdir = workdir
        self.bootstrap = bootstrap_servers
        self.admin = TopicAdmin({"bootstrap.servers": bootstrap_servers})
        self.stages: dict[str, list[BatchStats]] = {}  # ours, ours-mor: each batch's seconds per stage, per run
        self.configs: dict[str, ReplicaConfig] = {}  # ours, ours-mor: the replica of each run, to read its state
        self.probe_key: int | None = None  # a key live after the catch-up: the readers' point lookup
        # Topics of this run only: a broker given by --bootstrap-servers may hold an earlier run's topics, whose
        # records would join this run's workload (and its figures) under the same names.
        self.run_id = uuid.uuid4().hex[:8]
        self.peer: Any = None
        if plan.profile:
            Recorder(spark, workdir / "profiles" / "warm-up.jfr").warm_up()
        if "peer" in plan.contenders:
            from replica_dev.bench_peer import Peer

            self.peer = Peer.load()

    # ------------------------------------------------------------------ producing
    def topic(self, name: str) -> str:
        name = f"{name}_{self.run_id}".replace("-", "_")  # the peer names a SQL temp view after its topic: no '-'
        self.admin.ensure(TopicSpec.local(name, partitions=self.plan.partitions), local=True)
        return name

    def produce(self, topic: str, events: Sequence[Event], encode: Encoder) -> None:
        settings = ProducerSettings(linger_ms=20, batch_size=1024 * 1024)
        started = last = time.monotonic()
        with ChangeProducer({"bootstrap.servers": self.bootstrap}, settings) as producer:
            for i, event in enumerate(events, start=1):
                producer.send_raw(topic, *encode(event))
                if time.monotonic() - last >= 10:
                    last = time.monotonic()
                    logger.info("  produced %d/%d to %s", i, len(events), topic)
            producer.flush()
        elapsed = time.monotonic() - started
        logger.info("  produced %d records to %s in %.1fs", len(events), topic, elapsed)

    def produce_paced(self, topic: str, events: Sequence[Event], encode: Encoder) -> list[Any]:
        """Write ``events`` at ``fresh_rate`` per second; returns (send wall time, delivery) per event."""
        sent = []
        settings = ProducerSettings(linger_ms=0)
        with ChangeProducer({"bootstrap.servers": self.bootstrap}, settings) as producer:
            started = time.monotonic()
            for i, event in enumerate(events, start=1):
                sent.append((time.time(), producer.send_raw(topic, *encode(event))))
                ahead = started + i / self.plan.fresh_rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)  # pacing the producer to the fixed rate, not synchronisation
            producer.flush()
        return sent

    # ------------------------------------------------------------------ contenders
    def start(
        self, contender: str, topic: str, name: str, batch_size: int | None, once: bool, prefill: int = 0
    ) -> StreamingQuery:
        """Start ``contender`` on ``topic`` with a new checkpoint and table under ``workdir/name``."""
        base = self.workdir / name
        shutil.rmtree(base, ignore_errors=True)
        if contender in OURS:
            cfg = self.replica_config(name, topic, batch_size, once, OURS[contender])
            self.configs[name] = cfg
            ensure_replica_tables(self.spark, cfg)
            if prefill:
                self.prefill(contender, str(base / "table"), prefill, topic)
            self.stages[name] = []
            hooks = BatchHooks(after_batch=self.stages[name].append)
            # Its tables are gone with the run: no names of it in the user's catalog.
            return start_replica(self.spark, cfg, available_now=once, hooks=hooks, register=False)
        if contender == "peer":
            query: StreamingQuery = self.peer.start(self.spark, self, topic, base, batch_size, once, prefill)
            return query
        reader = self.spark.readStream.format("kafka").options(**self.source_options(topic, batch_size))
        raw_df = reader.load()
        if contender == "ceiling":
            writer = raw_df.writeStream.format("delta").outputMode("append").option("path", str(base / "table"))
        else:
            if prefill:
                self.prefill(contender, str(base / "table"), prefill, topic)
            else:
                self.spark.createDataFrame([], naive_schema()).write.format("delta").save(str(base / "table"))
            writer = raw_df.writeStream.foreachBatch(naive_handler(str(base / "table")))
        writer = writer.queryName(name).option("checkpointLocation", str(base / "checkpoint"))
        writer = writer.trigger(availableNow=True) if once else writer.trigger(processingTime="0 seconds")
        return writer.start()

    def source_options(self, topic: str, batch_size: int | None) -> dict[str, str]:
        options = {
            "kafka.bootstrap.servers": self.bootstrap,
            "subscribe": topic,
            "startingOffsets": "earliest",
            "kafka.isolation.level": "read_committed",
            # Every contender's consumers wait for the broker as ours do (replica_lib.config.FETCH_MAX_WAIT_MS).
            "kafka.fetch.max.wait.ms": str(FETCH_MAX_WAIT_MS),
        }
        if batch_size:
            options["maxOffsetsPerTrigger"] = str(batch_size)
        return options

    def replica_config(
        self, name: str, topic: str, batch_size: int | None, once: bool, layout: str = COPY_ON_WRITE
    ) -> ReplicaConfig:
        """Our replica of run ``name``, written and validated as a user's replica file is (names: ``_`` for ``-``)."""
        base = self.workdir / name
        table = orders_table(topic, schema=BENCH_SCHEMA, target={"path": str(base / "table")}, layout=layout)
        if layout == MERGE_ON_READ:
            table["fold_every_batches"] = self.plan.fold_every_batches
        doc = replica_doc(
            name.replace("-", "_"),
            base,
            self.bootstrap,
            {"orders": table},
            replica={"checkpoint": str(base / "checkpoint"), "quarantine": {"path": str(base / "quarantine")}},
            trigger={"available_now": once, "interval": "0 seconds"},
            **({"source": {"max_offsets_per_trigger": batch_size}} if batch_size else {}),
        )
        return parse_replica(doc, "bench", {})

    def prefill(self, contender: str, path: str, rows: int, topic: str) -> None:
        """Append ``rows`` live keys ``0..rows-1`` (seq 0) to the contender's table, in files of ``ROWS_PER_FILE``."""
        started = time.monotonic()
        files = max(1, rows // ROWS_PER_FILE)
        df = prefill_rows(self.spark, rows, self.plan.value_bytes, files)
        if contender in OURS:  # merge-on-read: the base, which has the columns of a copy-on-write table
            df = df.select(
                *DATA_COLUMNS,
                F.lit(topic).alias("_src_topic"),
                F.lit(0).alias("_src_partition"),
                F.lit(-1).cast("long").alias("_src_offset"),
                F.lit(0).cast("long").alias("_src_seq"),
                F.timestamp_millis(F.col("updated_ms")).alias("_src_event_ts"),
            )
        elif contender == "peer":
            df = self.peer.prefill_frame(df)
        else:
            df = df.select(*DATA_COLUMNS, F.lit(0).cast("long").alias("seq"))
        df.write.format("delta").mode("append").save(path)
        logger.info("  prefilled %s with %d rows in %.1fs", path, rows, time.monotonic() - started)

    def run_once(self, contender: str, topic: str, name: str, batch_size: int | None, prefill: int = 0) -> Run:
        """Catch up on everything in ``topic`` (available-now); wall time from start to the last commit.

        A fold of merge-on-read tables still running beside the batches when the last one ended is waited for
        (the stop does) and reported apart (``stop_s``): readers see the whole state once the batches end.
        """
        started = time.monotonic()
        query = self.start(contender, topic, name, batch_size, once=True, prefill=prefill)
        if prefill:
            started = time.monotonic()  # the prefill is not part of the run
        query.awaitTermination()
        ended = time.monotonic()
        query.stop()
        run = Run(contender, seconds=ended - started, batches=progress_batches(query))
        run.stop_s = time.monotonic() - ended
        run.records = sum(b["rows"] for b in run.batches)
        run.stages = stage_medians(self.stages.get(name, []))
        logger.info(
            "  %s: %d records in %.1fs (%.0f events/s), %d batches",
            name,
            run.records,
            run.seconds,
            run.events_per_s,
            len(run.batches),
        )
        return run

    def run_rebuild(self, topic: str, name: str) -> Run:
        """Our rebuild of ``topic`` into empty tables, as ``jobs/rebuild.py`` runs it (a batch read up to the log's
        end, one batch); wall time from the call (plan and pre-flight included) to its return.

        Into a new folder each round: in the last round's, the rebuild would go on with its finished plan and write
        nothing.
        """
        shutil.rmtree(self.workdir / name, ignore_errors=True)
        cfg = self.replica_config(name, topic, None, once=True)
        root = str(self.workdir / name / "rebuilt")
        self.stages[name] = []
        started = time.monotonic()
        stats = rebuild(self.spark, cfg, root, hooks=BatchHooks(after_batch=self.stages[name].append))
        run = Run("ours", records=stats.records, seconds=time.monotonic() - started)
        run.batches = [{"rows": stats.records, "seconds": stats.seconds}]
        run.stages = stage_medians(self.stages[name])
        self.configs[name] = rebuild_config(cfg, root)  # what check() reads: the rebuilt tables
        logger.info("  %s: %d records in %.1fs (%.0f events/s)", name, run.records, run.seconds, run.events_per_s)
        return run

    def run_naive_bulk(self, topic: str, name: str, records: int) -> Run:
        """The naive pattern's rebuild: the whole log in one batch read, its decode (typed parses, no checks) and
        latest change per key, the upserts appended to a new table; no quarantine, no retained deletes, no
        provenance. What a rebuild costs that checks nothing: the floor under ours (``rebuild_vs_naive_bulk``)."""
        shutil.rmtree(self.workdir / name, ignore_errors=True)
        started = time.monotonic()
        options = {**self.source_options(topic, None), "endingOffsets": "latest"}
        latest = naive_latest(self.spark.read.format("kafka").options(**options).load())
        rows = latest.where(F.col("op") == "upsert").select(*DATA_COLUMNS, "seq")
        rows.write.format("delta").save(str(self.workdir / name / "table"))
        run = Run("naive", records=records, seconds=time.monotonic() - started)
        run.batches = [{"rows": records, "seconds": run.seconds}]
        logger.info("  %s: %d records in %.1fs (%.0f events/s)", name, run.records, run.seconds, run.events_per_s)
        return run

    def check(self, contender: str, name: str, events: Sequence[Event]) -> dict[str, int] | None:
        """Compare a contender's table with the workload folded per key (key -> seq of the live row).

        A fast wrong answer is no answer: every contender that maintains a table is checked; the ceiling only
        appends records, so it has nothing to check.
        """
        column = {"ours": "_src_seq", "ours-mor": "_src_seq", "naive": "seq", "peer": "__log_sequence_number"}
        if contender not in column:
            return None
        expected = live_seqs(events)
        if contender in OURS:
            table = read_state(self.spark, self.configs[name].tables[0])
        else:
            table = self.spark.read.format("delta").load(str(self.workdir / name / "table"))
        actual = {int(r[0]): int(r[1]) for r in table.select("order_id", column[contender]).collect()}
        result = {
            "rows": len(actual),
            "missing": sum(1 for k in expected if k not in actual),
            "extra": sum(1 for k in actual if k not in expected),
            "different": sum(1 for k, v in expected.items() if k in actual and actual[k] != v),
        }
        level = logging.INFO if result["missing"] + result["extra"] + result["different"] == 0 else logging.ERROR
        logger.log(level, "  %s against the model: %s", name, result)
        return result

    # ------------------------------------------------------------------ phases
    def encoder(self, contender: str) -> Encoder:
        return self.peer.record if contender == "peer" else native_record

    def floor(self, report: dict[str, Any]) -> None:
        """What any batch pays on this machine whatever its size: the fixed cost the contenders build on.

        Medians of the plan's ``repeats`` runs (after one warm-up) of a trivial Spark job, a 20-row Delta append and
        a plain 20-row Delta MERGE into a 100,000-row table with deletion vectors, as a replica table has.
        """
        path = str(self.workdir / "floor" / "table")
        prefill_rows(self.spark, FLOOR_ROWS, self.plan.value_bytes, 1).write.format("delta").option(
            "delta.enableDeletionVectors", "true"
        ).save(path)
        changes = prefill_rows(self.spark, 20, self.plan.value_bytes, 1).withColumn("op", F.lit("upsert"))
        changes = changes.localCheckpoint()
        actions: dict[str, Callable[[], Any]] = {
            "spark_job_s": lambda: self.spark.range(1).count(),
            "delta_append_20_rows_s": lambda: changes.drop("op").write.format("delta").mode("append").save(path),
            "delta_merge_20_rows_s": lambda: merge_naive(
                self.spark, path, changes, "order_id", "order_id", list(DATA_COLUMNS)
            ),
        }
        results = {name: median_seconds(action, self.plan.repeats)[0] for name, action in actions.items()}
        logger.info("  floor: %s", results)
        report["floor"] = results
        shutil.rmtree(self.workdir / "floor", ignore_errors=True)

    def catch_up(self, report: dict[str, Any]) -> None:
        plan = self.plan
        events = workload(plan.keys, plan.events, plan.delete_share, plan.value_bytes, plan.seed)
        report["workload"]["ops"] = {
            "upserts": sum(e.op == "upsert" for e in events),
            "deletes": sum(e.op == "delete" for e in events),
            "distinct_keys": len({e.key for e in events}),
        }
        formats = {"native": native_record} | ({"peer": self.peer.record} if self.peer else {})
        topics = {}
        for fmt, encode in formats.items():
            topics[fmt] = self.topic(f"bench-{fmt}")
            self.produce(topics[fmt], events, encode)
        if plan.warmup_events:
            logger.info(
                "warm-up: every contender on %d events, %d per batch (not measured)",
                plan.warmup_events,
                plan.batch_size,
            )
            warm = workload(plan.keys, plan.warmup_events, plan.delete_share, plan.value_bytes, plan.seed + 1)
            warm_topics: dict[str, str] = {}
            for contender in plan.contenders:
                fmt = "peer" if contender == "peer" else "native"
                if fmt not in warm_topics:
                    warm_topics[fmt] = self.topic(f"warmup-{fmt}")
                    self.produce(warm_topics[fmt], warm, formats[fmt])
                self.run_once(contender, warm_topics[fmt], f"warmup-{contender}", plan.batch_size)
        logger.info("catch-up: %d events, %d per batch", plan.events, plan.batch_size)
        self.in_rounds(report, "catch_up", "events_per_s", lambda _: self.catch_up_round(topics, events))
        expected = live_seqs(events)
        self.probe_key = next((e.key for e in reversed(events) if expected.get(e.key) == e.seq), None)

    def catch_up_round(self, topics: dict[str, str], events: Sequence[Event]) -> dict[str, dict[str, Any]]:
        """Each contender's catch-up in turn (a new table and checkpoint each round), then the rebuild."""
        plan = self.plan
        results = {}
        for contender in plan.contenders:
            topic = topics["peer" if contender == "peer" else "native"]
            name = f"catchup-{contender}"  # the same name each round: the readers read the last round's table
            results[contender] = self.measured(name, partial(self.run_once, contender, topic, name, plan.batch_size))
            results[contender]["check"] = self.check(contender, name, events)
        if "ours" in plan.contenders:
            logger.info(
                "rebuild: the whole log in one batch, ceiling and ours (replica_lib.rebuild, as jobs/rebuild.py)"
            )
            native = topics["native"]
            results["ceiling_bulk"] = self.measured(
                "rebuild-ceiling", lambda: self.run_once("ceiling", native, "rebuild-ceiling", None)
            )
            results["ceiling_bulk"]["check"] = None  # raw records appended: nothing to check
            results["rebuild"] = self.measured("rebuild-ours", lambda: self.run_rebuild(native, "rebuild-ours"))
            results["rebuild"]["check"] = self.check("ours", "rebuild-ours", events)
            results["naive_bulk"] = self.measured(
                "rebuild-naive", lambda: self.run_naive_bulk(native, "rebuild-naive", len(events))
            )
            results["naive_bulk"]["check"] = self.check("naive", "rebuild-naive", events)
        return results

    def measured(self, name: str, run: Callable[[], Run]) -> dict[str, Any]:
        """``run``'s summary; with the plan's ``profile``, also where its CPU went (recorded under ``profiles/``)."""
        if not self.plan.profile:
            return run().summary()
        path = self.workdir / "profiles" / f"{name}-{uuid.uuid4().hex[:6]}.jfr"
        with Recorder(self.spark, path) as recording:
            summary = run().summary()
        summary["profile"] = read(path, recording.java_home).as_dict()
        return summary

    def in_rounds(
        self, report: dict[str, Any], phase: str, by: str, run_round: Callable[[int], dict[str, dict[str, Any]]]
    ) -> None:
        """Run ``phase`` the plan's number of rounds: ``report[phase]`` is each contender's median round (by the
        figure ``by``), ``report[phase + "_rounds"]`` every round, when there are several."""
        rounds = []
        for number in range(1, self.plan.rounds + 1):
            if self.plan.rounds > 1:
                logger.info("%s round %d of %d", phase.replace("_", "-"), number, self.plan.rounds)
            rounds.append(run_round(number))
        report[phase] = median_round(rounds, by)
        if len(rounds) > 1:
            report[f"{phase}_rounds"] = rounds

    def readers(self, report: dict[str, Any]) -> None:
        """What a reader of our caught-up tables pays: an aggregate and a point lookup of the state.

        A merge-on-read table is read twice: with the changes the catch-up left pending (its readers rank them
        against the base), then after one fold (timed too), when the state is the base alone.
        """
        results: dict[str, dict[str, Any]] = {}
        for contender in (c for c in OURS if c in self.plan.contenders):
            cfg = self.configs[f"catchup-{contender}"]
            table = cfg.tables[0]
            if not table.merge_on_read:
                results[contender] = self.read_costs(table)
                logger.info("  readers of %s: %s", contender, results[contender])
                continue
            pending = read_table(self.spark, changes_target(table)).count()
            entry: dict[str, Any] = {"pending_changes": pending, "pending": self.read_costs(table)}
            started = time.monotonic()
            folded = fold(self.spark, cfg.name, table_schema(table, cfg.source_file))
            entry["fold_s"] = round(time.monotonic() - started, 3)
            entry["folded_keys"] = folded.keys
            entry["folded"] = self.read_costs(table)
            results[contender] = entry
            logger.info("  readers of %s: %s", contender, entry)
        report["readers"] = results

    def read_costs(self, table: TableConfig) -> dict[str, Any]:
        """Median seconds of the plan's ``repeats`` runs (after one warm-up) of each query, from reading the
        state on."""

        def aggregate() -> list[Any]:
            return read_state(self.spark, table).agg(F.count(F.lit(1)), F.sum("amount")).collect()

        def point(key: int) -> list[Any]:
            return read_state(self.spark, table).where(F.col("order_id") == F.lit(key)).collect()

        repeats = self.plan.repeats
        seconds, first = median_seconds(aggregate, repeats)
        result: dict[str, Any] = {"rows": int(first[0][0]), "aggregate_s": seconds}
        key = self.probe_key
        if key is not None:
            result["point_s"], found = median_seconds(lambda: point(key), repeats)
            if len(found) != 1:
                logger.error("  point lookup of key %d in %s found %d rows", key, table.target.describe(), len(found))
        return result

    def freshness(self, report: dict[str, Any]) -> None:
        plan = self.plan
        count = plan.fresh_rate * plan.fresh_seconds
        events = workload(max(plan.fresh_rows, 1), count, plan.delete_share, plan.value_bytes, plan.seed + 2, True)
        self.in_rounds(
            report,
            "freshness",
            "fresh_p99_s",
            lambda number: self.fresh_round(events, "" if number == 1 else f"-{number}"),
        )

    def fresh_round(self, events: Sequence[Event], suffix: str) -> dict[str, dict[str, Any]]:
        """Each freshness contender in turn, on a topic of its own for this round."""
        plan = self.plan
        results = {}
        for contender in plan.fresh_contenders or plan.contenders:
            name = f"fresh-{contender}"
            topic = self.topic(f"fresh-{contender}{suffix}")
            logger.info(
                "freshness: %s at %d events/s for %ds into %d rows",
                contender,
                plan.fresh_rate,
                plan.fresh_seconds,
                plan.fresh_rows if contender != "ceiling" else 0,
            )
            query = self.start(contender, topic, name, None, once=False, prefill=plan.fresh_rows)
            sent = self.produce_paced(topic, events, self.encoder(contender))
            positions = [(at, d.result()) for at, d in sent]
            last: dict[tuple[str, int], int] = {}
            for _, pos in positions:
                last[(pos.topic, pos.partition)] = max(last.get((pos.topic, pos.partition), -1), pos.offset)
            wait_until_read(query, last, deadline_s=600)
            query.stop()
            batches = progress_batches(query)
            lags = freshness_lags(positions, batches)
            times = [b["seconds"] for b in batches if b["rows"] > 0]
            results[contender] = {
                "events": len(positions),
                "fresh_p50_s": _round(percentile(lags, 50)),
                "fresh_p99_s": _round(percentile(lags, 99)),
                "fresh_max_s": _round(max(lags) if lags else None),
                "batches": len(times),
                "batch_p50_s": _round(percentile(times, 50)),
                "batch_p99_s": _round(percentile(times, 99)),
            }
            logger.info("  %s: %s", contender, results[contender])
            shutil.rmtree(self.workdir / name, ignore_errors=True)
        return results

    def growth(self, report: dict[str, Any]) -> None:
        """Ours on each layout, same batch size, growing tables: keys drawn uniformly (every file touched), then
        recent keys. A merge-on-read table's batches never read the table; its fold does, so one fold of the
        batches' changes is timed after them (``report["growth_mor"]``; copy-on-write in ``report["growth"]``)."""
        plan = self.plan
        contenders = [c for c in GROWTH_REPORTS if c in plan.contenders]
        results: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in contenders}
        for keys in plan.growth_keys:
            for rows in plan.growth_rows:
                first = max(0, rows - RECENT_KEYS) if keys == "recent" else 0
                count = plan.growth_batch_size * plan.growth_batches
                events = workload(rows, count, plan.delete_share, plan.value_bytes, plan.seed + 3, True, first)
                topic = self.topic(f"growth-{keys}-{rows}")
                self.produce(topic, events, native_record)
                for contender in contenders:
                    results[contender].setdefault(keys, {})[str(rows)] = self.grow(contender, topic, keys, rows)
        for contender, result in results.items():
            report[GROWTH_REPORTS[contender]] = result

    def grow(self, contender: str, topic: str, keys: str, rows: int) -> dict[str, Any]:
        """One contender's batches into a table prefilled with ``rows`` rows (and, merge-on-read, its fold)."""
        plan = self.plan
        logger.info(
            "growth: %s, %d rows, %s keys, %d batches of %d",
            contender,
            rows,
            keys,
            plan.growth_batches,
            plan.growth_batch_size,
        )
        name = f"growth-{contender}-{keys}-{rows}"
        run = self.run_once(contender, topic, name, plan.growth_batch_size, prefill=rows)
        times = run.batch_seconds()
        steady = times[1:] if len(times) > 1 else times  # the first batch also loads the table's snapshot
        result: dict[str, Any] = {
            "batch_p50_s": _round(percentile(steady, 50)),
            "batch_max_s": _round(max(steady) if steady else None),
            "first_batch_s": _round(times[0] if times else None),
            "batches": [round(t, 3) for t in times],
            "stages_p50_s": run.stages,
        }
        if OURS[contender] == MERGE_ON_READ:
            cfg = self.configs[name]
            started = time.monotonic()
            folded = fold(self.spark, cfg.name, table_schema(cfg.tables[0], cfg.source_file))
            result["fold_s"] = round(time.monotonic() - started, 3)
            result["folded_keys"] = folded.keys
        logger.info("  %d rows, %s keys: %s", rows, keys, result)
        shutil.rmtree(self.workdir / name, ignore_errors=True)
        return result


def live_seqs(events: Sequence[Event]) -> dict[int, int]:
    """The workload folded per key: each live key's seq (each key's events are in seq order, as in its partition)."""
    expected: dict[int, int] = {}
    for event in events:
        if event.op == "delete":
            expected.pop(event.key, None)
        else:
            expected[event.key] = event.seq
    return expected


def median_seconds(action: Callable[[], Any], repeats: int = REPEATS) -> tuple[float | None, Any]:
    """Median wall seconds of ``repeats`` runs of ``action`` after one unmeasured run (which warms the JVM's code
    and Delta's snapshot cache as a reader's earlier queries would), and what that first run returned."""
    first = action()
    times = []
    for _ in range(repeats):
        started = time.monotonic()
        action()
        times.append(time.monotonic() - started)
    return _round(percentile(times, 50)), first


def wait_until_read(query: StreamingQuery, last: dict[tuple[str, int], int], deadline_s: float) -> None:
    """Poll the query's progress until it has read past every offset in ``last`` (or fail at the deadline)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not query.isActive:
            query.awaitTermination()  # raises the query's failure
            raise RuntimeError(f"query {query.name} stopped before reading everything")
        done: dict[tuple[str, int], int] = {}
        for batch in progress_batches(query):
            done.update(batch["ends"])
        if all(done.get(tp, -1) > offset for tp, offset in last.items()):
            return
        query.awaitTermination(1)
    raise RuntimeError(f"query {query.name} did not catch up within {deadline_s:.0f}s")


def freshness_lags(positions: Sequence[tuple[float, Any]], batches: Sequence[dict[str, Any]]) -> list[float]:
    """Per record: seconds from its send to the end of the first batch whose end offsets are past it."""
    ordered = sorted(batches, key=lambda b: b["batch_id"])
    lags = []
    for sent_at, pos in positions:
        tp = (pos.topic, pos.partition)
        for batch in ordered:
            if batch["ends"].get(tp, -1) > pos.offset:
                lags.append(batch["end"] - sent_at)
                break
    return lags


def naive_schema() -> T.StructType:
    """The naive contender's table: the data columns and the change's seq."""
    data = T.DataType.fromDDL(BENCH_SCHEMA)
    assert isinstance(data, T.StructType)
    return T.StructType([*data.fields, T.StructField("seq", T.LongType())])


def naive_latest(raw_df: DataFrame) -> DataFrame:
    """The hand-written pattern's decode: parse key and value as typed (no checks), keep the latest change per key.

    Columns ``key_id, op, seq`` and the data columns."""
    envelope = T.StructType(
        [
            T.StructField("op", T.StringType()),
            T.StructField("seq", T.LongType()),
            T.StructField("data", T.DataType.fromDDL(BENCH_SCHEMA)),
        ]
    )
    parsed = raw_df.select(
        F.from_json(F.col("key").cast("string"), "order_id BIGINT")["order_id"].alias("key_id"),
        F.from_json(F.col("value").cast("string"), envelope).alias("e"),
    ).select("key_id", "e.op", "e.seq", "e.data.*")
    latest = Window.partitionBy("key_id").orderBy(F.col("seq").desc())
    return parsed.withColumn("_rn", F.row_number().over(latest)).where("_rn = 1").drop("_rn")


def naive_handler(path: str) -> Callable[[DataFrame, int], None]:
    """The hand-written pattern: parse, keep the latest change per key in the batch, MERGE it."""

    def handle(batch_df: DataFrame, batch_id: int) -> None:
        deduped = naive_latest(batch_df)
        merge_naive(batch_df.sparkSession, path, deduped, "key_id", "order_id", [*DATA_COLUMNS, "seq"])

    return handle


def prefill_rows(spark: SparkSession, rows: int, value_bytes: int, files: int) -> DataFrame:
    """``rows`` live orders with keys ``0..rows-1``, range-partitioned by key into ``files`` files."""
    note = F.substring(F.repeat(F.sha2(F.col("id").cast("string"), 256), max(1, value_bytes // 64 + 1)), 1, value_bytes)
    customers = F.array(*[F.lit(c) for c in CUSTOMERS])
    return spark.range(0, rows, 1, files).select(
        F.col("id").alias("order_id"),
        customers[F.col("id") % len(CUSTOMERS)].alias("customer"),
        (F.col("id") % 500 + 5).cast("double").alias("amount"),
        F.lit("new").alias("status"),
        F.lit(1_700_000_000_000).cast("long").alias("updated_ms"),
        note.alias("note"),
    )


def run_bench(spark: SparkSession, plan: BenchPlan, workdir: Path, bootstrap_servers: str) -> dict[str, Any]:
    """Every phase of ``plan``; returns the report (also what :func:`write_report` saves)."""
    import os
    import platform

    bench = Bench(spark, plan, workdir, bootstrap_servers)
    report: dict[str, Any] = {
        "started": datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cores": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(),
            "spark": spark.version,
            "master": spark.sparkContext.master,
            "shuffle_partitions": spark.conf.get("spark.sql.shuffle.partitions"),
        },
        "workload": asdict(plan),
    }
    if bench.peer is not None:
        report["peer"] = bench.peer.describe()
    # The floor after the catch-up, so that it measures a warm JVM as the contenders' batches do.
    phases: list[tuple[str, Callable[[dict[str, Any]], None]]] = [("catch_up", bench.catch_up)]
    if any(contender in OURS for contender in plan.contenders):
        phases.append(("readers", bench.readers))
    phases.append(("floor", bench.floor))
    if plan.fresh_seconds and plan.fresh_rate:
        phases.append(("freshness", bench.freshness))
    if plan.growth_rows and any(contender in GROWTH_REPORTS for contender in plan.contenders):
        phases.append(("growth", bench.growth))
    for phase, run in phases:
        started = time.monotonic()
        run(report)
        logger.info("%s done in %.0fs", phase, time.monotonic() - started)
    report["ratios"] = ratios(report)
    shape = batch_shape(spark)
    if shape:
        report["shape"] = shape
    return report


def event_log_conf(folder: Path) -> dict[str, str]:
    """Spark settings that write the run's event log, plain JSON in one file, for :func:`batch_shape`."""
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": folder.resolve().as_uri(),
        "spark.eventLog.compress": "false",
        "spark.eventLog.rolling.enabled": "false",
    }


def batch_shape(spark: SparkSession) -> list[dict[str, Any]]:
    """Per contender and phase: median Spark jobs, stages, tasks, and driver time per batch, from the event log.

    The log is read as written so far (Spark flushes it as it goes); empty without an event log.
    """
    from urllib.parse import urlparse

    from replica_dev.eventlog import read_batches, summary

    if spark.conf.get("spark.eventLog.enabled", "false") != "true":
        return []
    folder = Path(str(urlparse(spark.conf.get("spark.eventLog.dir") or "").path))
    log = folder / spark.sparkContext.applicationId
    if not log.is_file():
        candidates = sorted(folder.glob(f"{spark.sparkContext.applicationId}*"))
        if not candidates:
            return []
        log = candidates[0]
    return summary(read_batches(log))


def median_round(rounds: Sequence[dict[str, dict[str, Any]]], by: str = "events_per_s") -> dict[str, dict[str, Any]]:
    """Each contender as its median round (by the figure ``by``; the lower middle of an even count) showed it,
    with every round's figure beside it (``rounds_<by>``) when there were several."""
    result = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds if name in r]
        chosen = sorted(runs, key=lambda run: float(run.get(by) or 0))[(len(runs) - 1) // 2]
        every = {f"rounds_{by}": [run.get(by) for run in runs]} if len(runs) > 1 else {}
        result[name] = {**chosen, **every}
    return result


def _div(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def catch_up_ratios(catch: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The catch-up targets as ratios of one round's figures."""

    def rate(name: str) -> float | None:
        value = catch.get(name, {}).get("events_per_s")
        return float(value) if value else None

    best = max((r for r in (rate("ours"), rate("ours-mor")) if r is not None), default=None)
    result: dict[str, float | None] = {}
    for label, ours in (("ours", rate("ours")), ("ours_mor", rate("ours-mor")), ("best", best)):
        for other in ("ceiling", "naive", "peer"):
            result[f"{label}_vs_{other}"] = _div(ours, rate(other))
    result["rebuild_vs_ceiling"] = _div(rate("rebuild"), rate("ceiling_bulk"))
    result["naive_bulk_vs_ceiling"] = _div(rate("naive_bulk"), rate("ceiling_bulk"))
    result["rebuild_vs_naive_bulk"] = _div(rate("rebuild"), rate("naive_bulk"))
    return result


def fresh_ratios(fresh: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The freshness targets as ratios of one round's p99s."""

    def p99(name: str) -> float | None:
        value = fresh.get(name, {}).get("fresh_p99_s")
        return float(value) if value is not None else None

    return {
        "ours_fresh_p99_vs_ceiling": _div(p99("ours"), p99("ceiling")),
        "ours_mor_fresh_p99_vs_ceiling": _div(p99("ours-mor"), p99("ceiling")),
    }


def round_ratios(report: dict[str, Any]) -> dict[str, list[float | None]]:
    """Each catch-up and freshness ratio in every round, in the order the rounds ran (none for one round)."""
    result: dict[str, list[float | None]] = {}
    for rounds_key, of_round in (("catch_up_rounds", catch_up_ratios), ("freshness_rounds", fresh_ratios)):
        per_round = [of_round(r) for r in report.get(rounds_key) or []]
        if per_round:
            result |= {key: [r[key] for r in per_round] for key in per_round[0]}
    return result


def ratios(report: dict[str, Any]) -> dict[str, float | None]:
    """The issue's targets as ratios of this run's figures: those of the catch-up and the freshness as the median
    of their rounds' ratios, each taken within one round (the median of an even count: the mean of the middle two)."""
    result = catch_up_ratios(report.get("catch_up", {}))
    fresh = report.get("freshness")
    if fresh:
        result |= fresh_ratios(fresh)
    for key, values in round_ratios(report).items():
        known = [v for v in values if v is not None]
        result[key] = round(statistics.median(known), 2) if known else None
    for entry in GROWTH_REPORTS.values():
        for keys, sizes in report.get(entry, {}).items():
            ordered = sorted(sizes, key=int)
            if not ordered:
                continue
            largest, smallest = sizes[ordered[-1]], sizes[ordered[0]]
            result[f"{entry}_{keys}_largest_vs_smallest"] = _div(largest["batch_p50_s"], smallest["batch_p50_s"])
            if "fold_s" in largest:
                result[f"{entry}_{keys}_fold_largest_vs_smallest"] = _div(largest["fold_s"], smallest["fold_s"])
    return result


def summary_lines(report: dict[str, Any]) -> Iterator[str]:
    """The report as a readable table."""
    catch, fresh = report.get("catch_up", {}), report.get("freshness", {})
    yield f"{'contender':<14}{'events/s':>10}{'batch p50':>11}{'batch p99':>11}{'fresh p50':>11}{'fresh p99':>11}"
    for name in [*CONTENDERS, *ONE_BATCH]:
        if name not in catch and name not in fresh:
            continue
        c, f = catch.get(name, {}), fresh.get(name, {})

        def cell(value: Any, unit: str = "s") -> str:
            return "-" if value is None else f"{value:.2f}{unit}"

        yield (
            f"{name:<14}{c.get('events_per_s', 0):>10.0f}{cell(c.get('batch_p50_s')):>11}"
            f"{cell(c.get('batch_p99_s')):>11}{cell(f.get('fresh_p50_s')):>11}{cell(f.get('fresh_p99_s')):>11}"
        )
    stops = {name: c["stop_s"] for name, c in catch.items() if c.get("stop_s", 0) >= 0.1}
    if stops:  # ours-mor: a fold still running beside the last batches, not in the figures above
        yield "catch-up, the stop after the last batch (a fold in flight): " + ", ".join(
            f"{name} {seconds:.2f}s" for name, seconds in stops.items()
        )
    floor = report.get("floor")
    if floor:
        yield "fixed cost on this machine (p50): " + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in floor.items())
    for contender in OURS:
        stages = catch.get(contender, {}).get("stages_p50_s")
        if stages:
            yield f"{contender}, one catch-up batch (p50): " + ", ".join(f"{k} {v:.2f}s" for k, v in stages.items())
    profiles = {name: c["profile"] for name, c in catch.items() if c.get("profile")}
    if profiles:
        yield "where the CPU went (JVM flight recordings; each contender's median round):"
        yield from table(profiles, {name: catch[name]["records"] for name in profiles})
    readers = report.get("readers")
    if readers:
        repeats = report.get("workload", {}).get("repeats", REPEATS)
        yield f"readers (median of {repeats}): " + "; ".join(reader_parts(readers))
    for contender, entry in GROWTH_REPORTS.items():
        for keys, sizes in report.get(entry, {}).items():
            for rows, g in sorted(sizes.items(), key=lambda kv: int(kv[0])):
                fold_part = f", fold {g['fold_s']}s" if "fold_s" in g else ""
                yield (
                    f"growth, {contender}, {keys} keys, {int(rows):>11,} rows: batch p50 {g['batch_p50_s']}s, "
                    f"max {g['batch_max_s']}s{fold_part}"
                )
    spread = round_ratios(report)
    for name, value in report.get("ratios", {}).items():
        known = [v for v in spread.get(name, []) if v is not None]
        rounds = f" (median of {len(known)} rounds: {', '.join(f'{v:.2f}' for v in known)})" if known else ""
        yield f"{name}: {value}{rounds}"
    shape = report.get("shape")
    if shape:
        from replica_dev.eventlog import format_summary

        yield "per batch, medians from Spark's event log (ms):"
        yield from format_summary(shape)


def reader_parts(readers: dict[str, dict[str, Any]]) -> Iterator[str]:
    """Each contender's reader costs as a phrase of the summary."""

    def costs(c: dict[str, Any]) -> str:
        point = c.get("point_s")
        return f"aggregate {c['aggregate_s']:.2f} s" + ("" if point is None else f", point {point:.2f} s")

    for contender, entry in readers.items():
        if "pending" not in entry:
            yield f"{contender} {costs(entry)}"
            continue
        yield (
            f"{contender} pending ({entry['pending_changes']} changes) {costs(entry['pending'])}, "
            f"folded {costs(entry['folded'])}; fold {entry['fold_s']:.2f} s"
        )


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Save the report as JSON and as a PNG plot; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = report["started"].replace(":", "").replace("-", "")
    json_path, png_path = out_dir / f"bench-{stamp}.json", out_dir / f"bench-{stamp}.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, png_path)
    return json_path, png_path


def _pairs(ax: Any, names: list[str], first: list[float], second: list[float], labels: tuple[str, str]) -> None:
    """Two bars per name, side by side (e.g. p50 and p99), the names under them."""
    width = 0.4
    xs = range(len(names))
    ax.bar([x - width / 2 for x in xs], first, width, label=labels[0])
    ax.bar([x + width / 2 for x in xs], second, width, label=labels[1])
    ax.set_xticks(list(xs), names)
    ax.legend(fontsize=8)


def plot(report: dict[str, Any], path: Path) -> None:
    """The run's figures as six panels: catch-up rate (and each contender's ratio to the ceiling), batch times,
    freshness, batch time as the table grows, reader costs, and the one-batch rebuild."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(17, 9))
    axes = list(grid.flat)
    catch = report.get("catch_up", {})
    names = [n for n in catch if n not in ONE_BATCH]
    rates = [catch[n]["events_per_s"] or 0 for n in names]
    bars = axes[0].bar(names, rates, color="tab:blue")
    ceiling = catch.get("ceiling", {}).get("events_per_s")
    if ceiling:  # each bar says its share of the ceiling's rate, inside it: the rounds' dots sit at its top
        axes[0].bar_label(bars, [f"{rate / ceiling:.2f}x" for rate in rates], label_type="center", color="white")
    axes[0].set_title("catch-up (events/s, higher is better; label: ÷ ceiling)")
    for x, name in enumerate(names):
        each = catch[name].get("rounds_events_per_s")
        if each:  # the median round's bar, a dot for every round
            axes[0].plot([x] * len(each), each, "o", color="black", markersize=3)
            axes[0].set_title(f"catch-up (events/s; bar: median of {len(each)} rounds, dots: each)")
    p50 = [catch[n]["batch_p50_s"] or 0 for n in names]
    p99 = [catch[n]["batch_p99_s"] or 0 for n in names]
    _pairs(axes[1], names, p50, p99, ("p50", "p99"))
    axes[1].set_title("catch-up batch time (s, lower is better)")
    fresh = report.get("freshness", {})
    fnames = list(fresh)
    _pairs(
        axes[2],
        fnames,
        [fresh[n]["fresh_p50_s"] or 0 for n in fnames],
        [fresh[n]["fresh_p99_s"] or 0 for n in fnames],
        ("p50", "p99"),
    )
    ceiling_p99 = fresh.get("ceiling", {}).get("fresh_p99_s")
    if ceiling_p99:  # the target: at most 1.3 times the ceiling's p99
        axes[2].axhline(1.3 * ceiling_p99, color="red", linestyle="--", linewidth=1, label="target p99 (1.3 x ceiling)")
        axes[2].legend(fontsize=8)
    axes[2].set_title(f"freshness at {report['workload']['fresh_rate']} events/s (s, lower is better)")
    for contender, entry in GROWTH_REPORTS.items():
        for keys, growth in report.get(entry, {}).items():
            sizes = sorted(growth, key=int)
            axes[3].plot(
                [int(s) for s in sizes],
                [growth[s]["batch_p50_s"] for s in sizes],
                marker="o",
                linestyle="-" if entry == "growth" else "--",
                label=f"{contender}, {keys}",
            )
    axes[3].set_xscale("log")
    if axes[3].lines:  # a run without the growth phase leaves it empty
        axes[3].legend(title="keys", fontsize=7)
    axes[3].set_title(f"batch of {report['workload']['growth_batch_size']} vs table rows (s)")
    axes[3].set_xlabel("table rows")
    readers: list[tuple[str, dict[str, Any]]] = []
    for contender, entry in report.get("readers", {}).items():
        if "pending" in entry:  # merge-on-read: with its changes pending, then folded
            readers += [(f"{contender}\n{entry['pending_changes']} pending", entry["pending"])]
            readers += [(f"{contender}\nfolded", entry["folded"])]
        else:
            readers.append((contender, entry))
    if readers:
        _pairs(
            axes[4],
            [name for name, _ in readers],
            [costs.get("aggregate_s") or 0 for _, costs in readers],
            [costs.get("point_s") or 0 for _, costs in readers],
            ("aggregate", "point lookup"),
        )
    axes[4].set_title("a reader's query of the state (s, median)")
    one = [n for n in ONE_BATCH if n in catch]
    labels = {"ceiling_bulk": "ceiling", "rebuild": "ours (rebuild)", "naive_bulk": "naive (no checks)"}
    seconds = [catch[n]["batch_p50_s"] or 0 for n in one]
    bars = axes[5].bar([labels[n] for n in one], seconds, color="tab:purple")
    if one and one[0] == "ceiling_bulk" and seconds[0]:  # each bar says its rate's share of the ceiling's
        axes[5].bar_label(bars, [f"{seconds[0] / s:.2f}x" if s else "" for s in seconds], fontsize=8)
    axes[5].set_title("the whole log in one batch (s; label: rate ÷ ceiling)")
    for ax in (axes[0], axes[1], axes[2], axes[5]):
        ax.tick_params(axis="x", labelsize=8, rotation=30)
    for ax in axes:  # a phase the run skipped (``--fresh-seconds 0``, ``--growth-rows ''``) says so
        if not ax.lines and not ax.patches:
            title = ax.get_title()
            ax.clear()
            ax.set_axis_off()
            ax.set_title(title)
            ax.text(0.5, 0.5, "not run", ha="center", va="center", color="gray", transform=ax.transAxes)
    machine = report["machine"]
    fig.suptitle(f"replica bench {report['started']} - {machine['cores']} cores, Spark {machine['spark']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
