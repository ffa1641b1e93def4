"""The fault harness: run a replica as a real ``spark-submit.sh`` process, kill it, restart it, check the oracle.

A producer writes a seeded keyed workload (inserts, updates, deletes) while the materializer runs; the harness
SIGKILLs the materializer's whole process group (driver and JVM) at random moments, and makes it kill itself at
named crash windows (``REPLICA_CRASH_AT``), restarting it on the same checkpoint each time. A plan may have some
windows crashed in the harness's own process instead (the batch raises at the window: the same files on disk, without
a launch's minute of JVM, session and cold first batch). At the end the oracle checks, against the reference model
(:mod:`replica_dev.model`):

* the table equals the model of every record consumed, row for row (no lost, extra, duplicate or stale rows);
* every Delta version equals the model applied to exactly the offsets that version records (time travel), so no
  intermediate state was ever wrong;
* each batch id is committed at most once per app id, and the applied offsets never go backwards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from replica_dev import loadgen
from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_dev.embedded_kafka import EmbeddedKafka
from replica_dev.faults import CRASH_ENV, CRASH_POINTS, WINDOWS, CrashPoint, InjectedCrash
from replica_dev.model import LoggedChange, fold
from replica_lib.config import COPY_ON_WRITE, MERGE_ON_READ, PROJECT_ROOT, TableConfig, load_replica
from replica_lib.layout import read_state
from replica_lib.merge import MERGE_DELETION_VECTORS, session_confs
from replica_lib.producer import Change, ChangeProducer
from replica_lib.progress import last_committed_offsets
from replica_lib.recovery import release_checkpoint
from replica_lib.stream import run_replica
from replica_lib.target import changes_target, tombstone_target
from replica_lib.topics import TopicAdmin, TopicSpec

logger = logging.getLogger(__name__)

_COLUMNS = (
    "order_id",
    "customer",
    "amount",
    "status",
    "updated_ms",
    "_src_topic",
    "_src_partition",
    "_src_offset",
    "_src_seq",
)


@dataclass(frozen=True)
class ChaosPlan:
    """What to inflict: ``kills`` random SIGKILLs, after a run of each crash window in ``crash_windows``."""

    keys: int = 200
    events: int = 0  # at least this many changes: the primary writes until the kills are done and this is reached
    kills: int = 10
    crash_windows: tuple[str, ...] | None = None  # None: every window of the layout (faults.WINDOWS)
    #: The windows crashed by a launched job's SIGKILL; None: all. The others are crashed in this process.
    killed_windows: tuple[str, ...] | None = None
    rate: float = 10.0  # changes per second, written throughout the run
    partitions: int = 3
    max_offsets_per_trigger: int = 500
    kill_delay_s: tuple[float, float] = (0.2, 4.0)  # after the restarted job's first batch
    seed: int = 1
    launch_timeout_s: float = 240.0
    #: None: each MERGE chooses (a table this small is rewritten); True or False: every MERGE writes deletion
    #: vectors, or none (through the Spark conf that decides for every MERGE, see replica_lib.merge).
    deletion_vectors: bool | None = None
    #: One table per layout, each fed by a topic of its own with the same workload (a merge-on-read table is
    #: folded every 2nd batch); the batches of a replica with both pass the windows of both.
    layouts: tuple[str, ...] = (COPY_ON_WRITE,)
    #: After the last restart, start a second instance of the running replica by mistake: it must fail at once
    #: and clearly, and the first must go on undisturbed.
    second_instance: bool = False
    #: The replica's compaction cadence (``[compaction] every_batches``). Every batch makes each compaction turn
    #: find the files its MERGE left beside the ones it only marked (deletion vectors), whatever the wall clock
    #: made of the batches; every 2nd lets a turn fall after a MERGE that rewrote the whole small table.
    compact_every_batches: int = 2

    def __post_init__(self) -> None:
        unknown_layouts = [layout for layout in self.layouts if layout not in WINDOWS]
        if unknown_layouts or not self.layouts or len(set(self.layouts)) != len(self.layouts):
            raise ValueError(f"layouts {list(self.layouts)}: give each of {', '.join(WINDOWS)} at most once")
        unknown = [w for w in self.windows if w not in layout_windows(self.layouts)]
        if unknown:
            raise ValueError(f"crash windows {unknown} are not passed by the batches of {', '.join(self.layouts)}")
        if self.killed_windows is not None and not set(self.killed_windows) <= set(self.windows):
            raise ValueError(f"killed windows {list(self.killed_windows)}: give some of {list(self.windows)}")
        if self.kills < 0 or self.keys < 1 or self.rate <= 0 or self.compact_every_batches < 1:
            raise ValueError("kills must be >= 0, keys >= 1, rate > 0 and compact_every_batches >= 1")

    @property
    def windows(self) -> tuple[str, ...]:
        return layout_windows(self.layouts) if self.crash_windows is None else self.crash_windows

    @property
    def tables(self) -> dict[str, str]:
        """Table name -> layout: ``orders`` for copy-on-write, ``orders_mor`` for merge-on-read."""
        return {TABLE_NAMES[layout]: layout for layout in self.layouts}


#: The harness's table for each layout.
TABLE_NAMES = {COPY_ON_WRITE: "orders", MERGE_ON_READ: "orders_mor"}


def layout_windows(layouts: Sequence[str]) -> tuple[str, ...]:
    """The crash windows that a batch of a replica with tables of ``layouts`` passes, in the order it passes them."""
    passed = {w for layout in layouts for w in WINDOWS[layout]}
    return tuple(w for w in CRASH_POINTS if w in passed)


@dataclass
class ChaosReport:
    """What happened and what the oracle found; everything in the second group must be 0."""

    events: int = 0
    keys: int = 0
    kills: int = 0  # random SIGKILLs of the materializer
    broker_kills: int = 0  # SIGKILLs of the broker (run_broker_outages)
    crashes: dict[str, int] = field(default_factory=dict)
    crashed_in_process: list[str] = field(default_factory=list)  # the windows of ``crashes`` hit in this process
    restarts: int = 0
    recovery_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    versions_checked: int = 0
    compactions: int = 0  # OPTIMIZE commits of the replica between its batches (no rows: not checked as versions)
    second_instance_refused: bool = False
    # must be zero:
    lost: int = 0
    extra: int = 0
    duplicates: int = 0
    stale: int = 0
    versions_wrong: int = 0
    batches_committed_twice: int = 0
    offsets_backwards: int = 0

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.extra
            or self.duplicates
            or self.stale
            or self.versions_wrong
            or self.batches_committed_twice
            or self.offsets_backwards
        )

    def lines(self) -> list[str]:
        recovery = (
            f"median {statistics.median(self.recovery_s):.1f}s, max {max(self.recovery_s):.1f}s"
            if self.recovery_s
            else "n/a"
        )
        return [
            f"events {self.events}, keys {self.keys}, random kills {self.kills}, "
            + (f"broker kills {self.broker_kills}, " if self.broker_kills else "")
            + f"crash windows {json.dumps(self.crashes, sort_keys=True)}"
            + (f" ({', '.join(self.crashed_in_process)} in process), " if self.crashed_in_process else ", ")
            + f"restarts {self.restarts}, {self.seconds:.0f}s",
            f"recovery (restart to first applied batch): {recovery}"
            + (", a second instance refused" if self.second_instance_refused else ""),
            f"Delta versions checked by time travel: {self.versions_checked}, compactions: {self.compactions}",
            f"lost {self.lost}, extra {self.extra}, duplicates {self.duplicates}, stale {self.stale}, "
            f"wrong versions {self.versions_wrong}, batches committed twice {self.batches_committed_twice}, "
            f"offsets going backwards {self.offsets_backwards}: {'OK' if self.ok else 'FAILED'}",
        ]


class _Producer(threading.Thread):
    """The primary: writes the seeded workload at ``rate`` until stopped, each change to every table's topic."""

    def __init__(self, connection: Mapping[str, str], topics: Mapping[str, str], plan: ChaosPlan) -> None:
        super().__init__(name="chaos-producer", daemon=True)
        self.connection, self.topics, self.plan = connection, dict(topics), plan
        self.stop = threading.Event()
        self.logged: list[LoggedChange] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            workload = loadgen.Workload(
                keys=self.plan.keys, events=max(self.plan.events, 1_000_000), seed=self.plan.seed
            )
            changes = loadgen.generate(workload)
            # Back on the broker within a second of its restart (librdkafka waits up to 10 s between attempts),
            # so the batch that shows the replica survived an outage comes as soon as the replica can make it.
            with ChangeProducer({**self.connection, "reconnect.backoff.max.ms": "1000"}) as producer:
                sent: list[tuple[Any, Change, str]] = []
                started = time.monotonic()
                for i, change in enumerate(changes):
                    if self.stop.is_set() and i >= self.plan.events:
                        break
                    sent += [(producer.send(topic, change), change, table) for table, topic in self.topics.items()]
                    ahead = started + (i + 1) / self.plan.rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)  # pacing the primary
                producer.flush()
                self.logged = [LoggedChange(d.result(), c, table) for d, c, table in sent]
        except BaseException as exc:  # reported by the harness
            self.error = exc


class Launch:
    """One run of ``spark-submit.sh [spark_options] jobs/materialize.py`` (or ``job``) in its own process group, its
    output in a file."""

    def __init__(
        self,
        conf: Path,
        log: Path,
        crash_at: str | None,
        deletion_vectors: bool | None = None,
        job: str = "jobs/materialize.py",
        args: Sequence[str] = (),
        spark_options: Sequence[str] = (),
    ) -> None:
        env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
        if crash_at:
            env[CRASH_ENV] = crash_at
            job = "jobs/dev/faulty_replica.py"  # random kills hit the user's job; a window needs the dev job's hook
        spark_options = list(spark_options)
        if deletion_vectors is not None:
            spark_options += ["--conf", f"{MERGE_DELETION_VECTORS}={str(deletion_vectors).lower()}"]
        self.log, self.job = log, job
        self.started = time.monotonic()
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [str(PROJECT_ROOT / "spark-submit.sh"), *spark_options, job, str(conf), *args],
                cwd=PROJECT_ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def applied_batches(self) -> int:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return sum(
            1
            for line in text.splitlines()
            if " batch " in line and "records in" in line and " 0 records in" not in line
        )

    def wait_for_batch(self, timeout_s: float) -> float:
        """Seconds from launch to its first applied batch with records."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.applied_batches():
                return time.monotonic() - self.started
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.job} exited ({self.proc.returncode}) early; see {self.log}")
            time.sleep(0.2)
        raise RuntimeError(f"{self.job} applied no batch within {timeout_s:.0f}s; see {self.log}")

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            self.kill()
            raise RuntimeError(f"{self.job} did not exit within {timeout_s:.0f}s; see {self.log}") from exc

    def kill(self) -> None:
        """SIGKILL the driver and its JVM at once, as a lost machine would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


class _Scenario:
    """One harness run: its topic and replica conf, the primary writing, the materializer launches, the report."""

    def __init__(self, plan: ChaosPlan, workdir: Path, bootstrap_servers: str, prefix: str) -> None:
        self.plan, self.workdir, self.started = plan, workdir, time.monotonic()
        workdir.mkdir(parents=True, exist_ok=True)
        connection = {"bootstrap.servers": bootstrap_servers}
        topics = {table: f"{prefix}-{plan.seed}-{int(time.time())}-{table}" for table in plan.tables}
        for topic in topics.values():
            TopicAdmin(connection).ensure(TopicSpec.local(topic, partitions=plan.partitions), local=True)
        self.conf = workdir / "chaos.toml"
        doc = replica_doc(
            "chaos",
            workdir / "data",
            bootstrap_servers,
            {table: orders_table(topics[table], **_layout(layout)) for table, layout in plan.tables.items()},
            source={"max_offsets_per_trigger": plan.max_offsets_per_trigger},
            trigger={"interval": "1 second"},
            compaction={"every_batches": plan.compact_every_batches},
        )
        write_replica(self.conf, doc)
        self.report = ChaosReport(keys=plan.keys)
        self.producer = _Producer(connection, topics, plan)
        self.producer.start()
        self.launches: list[Launch] = []

    def launch(self, crash_at: str | None = None) -> Launch:
        log = self.workdir / f"launch-{len(self.launches) + 1:03d}.log"
        self.launches.append(Launch(self.conf, log, crash_at, self.plan.deletion_vectors))
        return self.launches[-1]

    def stop_primary(self) -> None:
        self.producer.stop.set()
        self.producer.join(timeout=180)
        if self.producer.error is not None:
            raise RuntimeError(f"the producer failed: {self.producer.error}") from self.producer.error

    def drain_and_stop(self, spark: SparkSession, run: Launch) -> None:
        """Let ``run`` apply the whole log, then stop it with SIGTERM, which must end it cleanly."""
        _wait_caught_up(spark, self.conf, self.producer.logged, 3 * self.plan.launch_timeout_s)
        run.proc.send_signal(signal.SIGTERM)
        if run.wait_exit(120) != 0:
            raise RuntimeError(f"the last run did not stop cleanly on SIGTERM; see {run.log}")

    def judge(self, spark: SparkSession) -> ChaosReport:
        runs = len(self.launches) + len(self.report.crashed_in_process)  # each on the same checkpoint
        self.report.restarts = runs - 1 - self.report.second_instance_refused
        self.report.events = len(self.producer.logged)
        _oracle(spark, self.conf, self.producer.logged, self.report)
        self.report.seconds = time.monotonic() - self.started
        return self.report


def run_chaos(spark: SparkSession, plan: ChaosPlan, workdir: Path, bootstrap_servers: str) -> ChaosReport:
    """Run the plan against the cluster at ``bootstrap_servers``; returns the report (check ``report.ok``)."""
    rng = random.Random(plan.seed)
    run = _Scenario(plan, workdir, bootstrap_servers, "chaos")
    report = run.report
    try:
        for window in plan.windows:
            if plan.killed_windows is not None and window not in plan.killed_windows:
                _crash_in_process(spark, run, window)
                report.crashed_in_process.append(window)
            else:
                crashing = run.launch(crash_at=window)
                code = crashing.wait_exit(plan.launch_timeout_s)
                if code != -signal.SIGKILL:
                    raise RuntimeError(f"crash window {window}: expected the job to kill itself, exit code {code}")
                crashing.kill()  # its JVM too
                logger.info("crash window %s hit (launch %d)", window, len(run.launches))
            report.crashes[window] = report.crashes.get(window, 0) + 1
        for i in range(plan.kills):
            victim = run.launch()
            report.recovery_s.append(victim.wait_for_batch(plan.launch_timeout_s))
            time.sleep(rng.uniform(*plan.kill_delay_s))  # a random moment: mid-batch or between batches
            victim.kill()
            report.kills += 1
            logger.info(
                "random kill %d/%d after %.1fs (launch %d)",
                i + 1,
                plan.kills,
                time.monotonic() - victim.started,
                len(run.launches),
            )
        final = run.launch()
        report.recovery_s.append(final.wait_for_batch(plan.launch_timeout_s))
        if plan.second_instance:
            _refuse_second_instance(run, final)
        run.stop_primary()
        run.drain_and_stop(spark, final)
    finally:
        run.producer.stop.set()
    return run.judge(spark)


def _crash_in_process(spark: SparkSession, run: _Scenario, window: str) -> None:
    """Run the replica in this process until a batch (or a fold) raises at ``window``, as a launched job would be
    SIGKILLed there; then release the checkpoint's lock, which a dead process's kernel would have dropped."""
    cfg = load_replica(run.conf)
    crash = CrashPoint(window, in_process=True)
    dv = run.plan.deletion_vectors  # as a launch's --conf sets it
    confs = {} if dv is None else {MERGE_DELETION_VECTORS: str(dv).lower()}

    def give_up() -> None:  # should the window never come: run_replica returns without the crash
        for query in spark.streams.active:
            query.stop()

    timer = threading.Timer(run.plan.launch_timeout_s, give_up)
    timer.start()
    try:
        with session_confs(spark, confs):
            run_replica(spark, cfg, available_now=False, hooks=crash.hooks())
    except (StreamingQueryException, InjectedCrash):  # a batch's crash fails its query; a last fold's, the run
        if not crash.hit.is_set():
            raise
    finally:
        timer.cancel()
        release_checkpoint(cfg)
    if not crash.hit.is_set():
        raise RuntimeError(f"crash window {window}: not reached in process within {run.plan.launch_timeout_s:.0f}s")
    logger.info("crash window %s hit in process", window)


def _refuse_second_instance(run: _Scenario, first: Launch) -> None:
    """A second instance of the running ``first`` must fail at once and clearly, and leave ``first`` running."""
    second = run.launch()
    code = second.wait_exit(run.plan.launch_timeout_s)
    second.kill()
    if code != 2 or "is already running on checkpoint" not in second.log.read_text(errors="replace"):
        raise RuntimeError(f"the second instance did not fail clearly (exit {code}); see {second.log}")
    if first.proc.poll() is not None:
        raise RuntimeError(f"the first instance stopped (exit {first.proc.returncode}); see {first.log}")
    run.report.second_instance_refused = True
    logger.info("a second instance was refused (launch %d); the first goes on", len(run.launches))


def _layout(layout: str) -> dict[str, Any]:
    return {"layout": MERGE_ON_READ, "fold_every_batches": 2} if layout == MERGE_ON_READ else {}


def _end_offsets(logged: Sequence[LoggedChange]) -> dict[str, dict[int, int]]:
    ends: dict[str, dict[int, int]] = {}
    for event in logged:
        parts = ends.setdefault(event.position.topic, {})
        parts[event.position.partition] = max(parts.get(event.position.partition, 0), event.position.offset + 1)
    return ends


def _wait_caught_up(spark: SparkSession, conf: Path, logged: Sequence[LoggedChange], timeout_s: float) -> None:
    cfg = load_replica(conf)
    want = _end_offsets(logged)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        have = last_committed_offsets(spark, cfg.checkpoint) or {}
        if all(have.get(t, {}).get(p, 0) >= o for t, parts in want.items() for p, o in parts.items()):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the replica did not catch up with the log within {timeout_s:.0f}s")


def _rows(rows: Sequence[Any]) -> tuple[dict[tuple[Any, ...], dict[str, Any]], int]:
    """Rows keyed by order_id (the comparable columns only), and how many keys appear more than once."""
    keyed: dict[tuple[Any, ...], dict[str, Any]] = {}
    counts = Counter(row["order_id"] for row in rows)
    for row in rows:
        keyed[(row["order_id"],)] = {c: row[c] for c in _COLUMNS}
    return keyed, sum(1 for n in counts.values() if n > 1)


def _compare(
    actual: Mapping[tuple[Any, ...], dict[str, Any]], expected: Mapping[tuple[Any, ...], dict[str, Any]]
) -> tuple[int, int, int]:
    """(lost, extra, stale) of ``actual`` against ``expected``."""
    lost = len(expected.keys() - actual.keys())
    extra = len(actual.keys() - expected.keys())
    stale = sum(
        1
        for k in expected.keys() & actual.keys()
        if {c: actual[k][c] for c in _COLUMNS} != {c: expected[k].get(c) for c in _COLUMNS}
    )
    return lost, extra, stale


def _oracle(spark: SparkSession, conf: Path, logged: Sequence[LoggedChange], report: ChaosReport) -> None:
    cfg = load_replica(conf)
    for table in cfg.tables:
        _check_table(spark, table, [e for e in logged if e.table == table.name], report)


def _check_table(spark: SparkSession, table: TableConfig, logged: Sequence[LoggedChange], report: ChaosReport) -> None:
    """Add what the oracle finds in ``table`` (fed by ``logged``) to ``report``."""
    from delta.tables import DeltaTable

    path = table.target.path or ""
    keys, sequenced = {table.name: ("order_id",)}, {table.name: True}
    # The state readers see (a merge-on-read table's view); every version of the table itself is checked below:
    # a merge-on-read table's versions are its folds, each recorded at the offsets of the last batch it folded.
    actual, duplicates = _rows(read_state(spark, table).collect())
    lost, extra, stale = _compare(actual, fold(logged, keys, sequenced)[table.name])
    report.duplicates += duplicates
    report.lost, report.extra, report.stale = report.lost + lost, report.extra + extra, report.stale + stale

    history = DeltaTable.forPath(spark, path).history().select("version", "operation", "userMetadata")
    seen: Counter[tuple[str, int]] = Counter()
    previous: dict[str, dict[int, int]] = {}
    for row in history.orderBy("version").collect():
        report.compactions += row["operation"] == "OPTIMIZE"
        if not row["userMetadata"]:
            continue
        meta = json.loads(row["userMetadata"])
        seen[(meta["generation"], int(meta["batch_id"]))] += 1
        offsets = {t: {int(p): int(o) for p, o in parts.items()} for t, parts in meta["offsets"].items()}
        for topic, parts in offsets.items():
            for partition, offset in parts.items():
                if offset < previous.get(topic, {}).get(partition, 0):
                    report.offsets_backwards += 1
        previous = offsets
        prefix = [
            e for e in logged if e.position.offset < offsets.get(e.position.topic, {}).get(e.position.partition, 0)
        ]
        at_version, duplicated = _rows(
            spark.read.format("delta").option("versionAsOf", row["version"]).load(path).collect()
        )
        lost, extra, stale = _compare(at_version, fold(prefix, keys, sequenced)[table.name])
        report.versions_checked += 1
        if lost or extra or stale or duplicated:
            report.versions_wrong += 1
            logger.error(
                "%s version %d (offsets %s): lost %d, extra %d, stale %d, duplicated %d",
                table.name,
                row["version"],
                offsets,
                lost,
                extra,
                stale,
                duplicated,
            )
    if table.merge_on_read:  # each batch is committed to the change log, and to the table only by folds
        seen = _batch_commits(spark, changes_target(table).path or "")
    else:  # a batch with deletes also appends them to the tombstone table, once (batch._Retained.committed)
        tombstones = _batch_commits(spark, tombstone_target(table).path or "")
        seen.update({(f"{generation}:tombstones", batch): n for (generation, batch), n in tombstones.items()})
    report.batches_committed_twice += sum(n - 1 for n in seen.values() if n > 1)


def _batch_commits(spark: SparkSession, path: str) -> Counter[tuple[str, int]]:
    """How many commits of the Delta table at ``path`` carry each (generation, batch id) in their metadata."""
    from delta.tables import DeltaTable

    seen: Counter[tuple[str, int]] = Counter()
    history = DeltaTable.forPath(spark, path).history().select("userMetadata")
    for row in history.where("userMetadata IS NOT NULL").collect():
        meta = json.loads(row["userMetadata"])
        seen[(meta["generation"], int(meta["batch_id"]))] += 1
    return seen


def run_broker_outages(
    spark: SparkSession, plan: ChaosPlan, workdir: Path, broker: EmbeddedKafka, outages: int = 2
) -> ChaosReport:
    """Kill and restart the broker under a running materializer and producer, then start a materializer while
    the broker is down; the oracle must hold. A materializer that dies with the broker is restarted, as a
    supervisor would. ``report.broker_kills`` counts the broker's kills; ``report.restarts`` materializer restarts."""
    rng = random.Random(plan.seed)
    run = _Scenario(plan, workdir, broker.bootstrap_servers, "outage")
    report = run.report
    try:
        current = run.launch()
        report.recovery_s.append(current.wait_for_batch(plan.launch_timeout_s))
        for _ in range(outages):
            time.sleep(rng.uniform(*plan.kill_delay_s))
            broker.kill()
            report.broker_kills += 1
            time.sleep(rng.uniform(1.0, 5.0))  # the outage
            broker.start()
            done = current.applied_batches()
            deadline = time.monotonic() + plan.launch_timeout_s
            while current.applied_batches() <= done and time.monotonic() < deadline:
                if current.proc.poll() is not None:  # it gave up during the outage: its supervisor restarts it
                    current.kill()
                    current, done = run.launch(), 0
                time.sleep(0.5)
            if current.applied_batches() <= done:
                raise RuntimeError(f"no batch applied within {plan.launch_timeout_s:.0f}s after the broker came back")
        # A materializer started while the broker is down must fail clearly (or wait), then work once it is back.
        current.proc.send_signal(signal.SIGTERM)
        current.wait_exit(120)
        broker.kill()
        report.broker_kills += 1
        down = run.launch()
        code = down.wait_exit(plan.launch_timeout_s)
        down.kill()
        if code != 2 or "no Kafka broker reachable" not in down.log.read_text(errors="replace"):
            raise RuntimeError(
                f"a materializer started without a broker did not fail clearly (exit {code}); see {down.log}"
            )
        # The broker comes back while the next materializer's JVM starts, as a supervisor would restart both; the
        # materializer's start waits for a broker that is still starting up (replica_lib.source.check_reachable).
        broker.start(wait=False)
        final = run.launch()
        broker.wait_ready()
        run.stop_primary()
        report.recovery_s.append(final.wait_for_batch(plan.launch_timeout_s))
        run.drain_and_stop(spark, final)
    finally:
        run.producer.stop.set()
        if broker.pid is None:
            broker.start()
    return run.judge(spark)


def kill_a_rebuild(conf: Path, into: Path, log: Path, seed: int, within_s: float, timeout_s: float = 300.0) -> float:
    """Run ``jobs/rebuild.py conf --into into`` and SIGKILL it at a random moment (seeded) in the first
    ``within_s`` seconds after it recorded its plan, as a lost machine would. Returns that moment.

    Raises RuntimeError if the rebuild ended before the kill: ``within_s`` must be shorter than its work.
    """
    run = Launch(conf, log, None, job="jobs/rebuild.py", args=("--into", str(into)))
    deadline = time.monotonic() + timeout_s
    while "the log up to" not in (log.read_text(errors="replace") if log.exists() else ""):
        if run.proc.poll() is not None:
            raise RuntimeError(f"the rebuild exited ({run.proc.returncode}) before its plan; see {log}")
        if time.monotonic() > deadline:
            run.kill()
            raise RuntimeError(f"the rebuild recorded no plan within {timeout_s:.0f}s; see {log}")
        time.sleep(0.1)
    moment = random.Random(seed).uniform(0.0, within_s)
    time.sleep(moment)  # the kill's moment, drawn at random: fault injection, not synchronisation
    if run.proc.poll() is not None:
        raise RuntimeError(f"the rebuild ended ({run.proc.returncode}) before its kill at {moment:.1f}s; see {log}")
    run.kill()
    logger.info("killed the rebuild %.1f s after its plan", moment)
    return moment
