"""The one place that builds a SparkSession: Delta, Spark's Kafka source, the project's jar cache, and its catalog.

**The catalog.** Spark's own settings choose it: ``spark.sql.catalogImplementation=hive`` with
``spark.hadoop.hive.metastore.uris=thrift://…`` (or a ``hive-site.xml``) for a shared Hive metastore, or a
``spark.sql.catalog.spark_catalog`` of your own (Glue, Unity, …), given to ``spark-submit.sh`` as ``--conf``. When
none is given, a session that asks for a catalog (``catalog=True``: the SQL server, ``./replica catalog``,
``./replica sql``, notebooks) gets the local default: a Hive metastore in an embedded Derby database in
``<catalog>/metastore``, its warehouse in ``<catalog>/warehouse`` (``<catalog>`` is ``REPLICA_CATALOG_DIR``, by
default the state folder). Embedded Derby admits one JVM at a time, so replica jobs never open it: they leave their
catalog entries for whichever process holds it (:mod:`replica_lib.catalog`).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from replica_lib import artifacts
from replica_lib.config import LocalSettings
from replica_lib.errors import SetupError

logger = logging.getLogger(__name__)


#: Spark keeps 100 compiled query classes by default; one micro-batch (decoding, ordering, Delta's MERGE, its
#: snapshot and data-skipping queries) needs more, so with 100 every batch compiled ~100 classes again (~1 s of
#: a 5 s batch). Static: it must be set before the session starts.
CODEGEN_CACHE = {"spark.sql.codegen.cache.maxEntries": "2000"}

#: HotSpot's JIT compiles no method of more than 8,000 bytes of bytecode: such a method runs interpreted, several
#: times slower. A decode's whole-stage generated code has methods past that size (more of them the wider the
#: table), so the driver's and executors' JVMs compile methods of any size. ``spark-submit.sh`` starts a local
#: driver with the same option.
JAVA_OPTIONS = "-XX:-DontCompileHugeMethods"
JAVA_OPTIONS_SETTINGS = ("spark.driver.defaultJavaOptions", "spark.executor.defaultJavaOptions")

#: PySpark's DataFrame debugging (on by default): every ``pyspark.sql.functions`` call captures its Python call
#: site (a walk of the interpreter's stack) and sends it to the JVM in four py4j calls, so that a runtime error of
#: that expression names the line that built it. A column costs 4.5 ms with it and 0.9 ms without; a replica's
#: driver builds thousands of columns per run, and its errors are its own (:mod:`replica_lib.errors`). A launch
#: that sets it (``--conf spark.python.sql.dataFrameDebugging.enabled=true``) keeps its value.
PYTHON_DEBUGGING = "spark.python.sql.dataFrameDebugging.enabled"

#: How many Kafka consumers Spark keeps for reuse, one per partition read (its default: 64). Past that, every task
#: that takes a consumer closes the oldest idle ones and logs ``WARN InternalKafkaConsumerPool: Pool exceeds its soft
#: max size``: a replica of an 80-partition topic printed it 7 times a batch, and opened consumers again that it had
#: just closed. Idle consumers still close after Spark's timeout (5 minutes). A launch that sets it keeps its value.
KAFKA_CONSUMERS = "spark.kafka.consumer.cache.capacity"
#: Settings of :func:`session_conf` that a launch's own value (``--conf``, ``spark-defaults.conf``) overrides: an
#: administrator's JVM options (``spark-submit.sh``'s hold :data:`JAVA_OPTIONS` too) among them.
LAUNCH_OWN = (PYTHON_DEBUGGING, KAFKA_CONSUMERS, *JAVA_OPTIONS_SETTINGS)


#: Spark's scheduler pools (``resources/fairscheduler.xml``): the batches' and :data:`FOLD_POOL`.
SCHEDULER_POOLS = artifacts.RESOURCES / "fairscheduler.xml"
#: The scheduler pool of a fold beside the batches (``spark.scheduler.pool``, a thread's local property).
FOLD_POOL = "replica-fold"
#: The settings that choose how Spark shares its cores between jobs: ours unless the launch gives any of them.
SCHEDULER_SETTINGS = ("spark.scheduler.mode", "spark.scheduler.allocation.file")


#: The driver JVM's console log (``resources/log4j2.properties``): Spark's, a record on one line without its stack
#: trace, unless :attr:`LocalSettings.debug`. ``spark-submit.sh`` starts a local driver with it too.
CONSOLE_LOG = artifacts.RESOURCES / "log4j2.properties"


def scheduler_pools(settings: LocalSettings) -> Path:
    """:data:`SCHEDULER_POOLS` as a file Spark can read."""
    return _resource_file(settings, SCHEDULER_POOLS)


def driver_java_options(settings: LocalSettings) -> str:
    """The driver JVM's options: :data:`JAVA_OPTIONS`, and :data:`CONSOLE_LOG` unless the user asked for traces."""
    if settings.debug:
        return JAVA_OPTIONS
    return f"{JAVA_OPTIONS} -Dlog4j2.configurationFile={_resource_file(settings, CONSOLE_LOG)}"


def _resource_file(settings: LocalSettings, resource: Path) -> Path:
    """A file of ``resources/`` as a file the JVM can read: a package shipped zipped (a cluster job's
    ``--py-files``) holds it inside the zip, so it is written out to the state folder then."""
    if resource.is_file():
        return resource
    text = importlib.resources.files("replica_lib").joinpath("resources", resource.name).read_text()
    target = settings.state_dir / "spark" / resource.name
    if not target.is_file() or target.read_text() != text:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        partial.write_text(text)
        partial.replace(target)  # atomic: a driver starting beside reads the whole file
    return target


def session_conf(settings: LocalSettings, master: str | None, ui: bool) -> dict[str, str]:
    """Spark configuration for replica jobs; under ``spark-submit.sh`` most of it is already set."""
    local = master is not None and master.startswith("local")
    # A local JVM started here takes the jars resolved at an earlier start (artifacts.resolved_jars), if recorded.
    jars = artifacts.resolved_jars(artifacts.SPARK_PACKAGES, settings.state_dir / "ivy") if local else ()
    conf = {
        **({"spark.jars": ",".join(jars)} if jars else {"spark.jars.packages": ",".join(artifacts.SPARK_PACKAGES)}),
        "spark.jars.ivy": str(settings.state_dir / "ivy"),
        "spark.jars.ivySettings": str(artifacts.IVY_SETTINGS),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "true" if ui else "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.streaming.stopGracefullyOnShutdown": "true",
        # A fold beside the batches runs in a pool whose tasks start only on cores the batches leave idle.
        "spark.scheduler.mode": "FAIR",
        "spark.scheduler.allocation.file": str(scheduler_pools(settings)),
        # A replica's writes are its own: no surprise schema evolution, no retention-check bypass.
        "spark.databricks.delta.schema.autoMerge.enabled": "false",
        PYTHON_DEBUGGING: "false",
        KAFKA_CONSUMERS: "1024",
        **CODEGEN_CACHE,
        "spark.driver.defaultJavaOptions": driver_java_options(settings),
        "spark.executor.defaultJavaOptions": JAVA_OPTIONS,
    }
    if local:
        conf.update(
            {
                "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
                "spark.sql.shuffle.partitions": "4",
                "spark.default.parallelism": "4",
                # Delta rebuilds a table's snapshot with 50 tasks by default: minutes of overhead on 2 cores.
                SNAPSHOT_PARTITIONS: "2",
                # Delta's VACUUM lists a table's files in this many tasks (Spark's default: 10,000): 25-31 s of
                # tiny tasks for a three-file table on 2 cores, 2.4-3.4 s with 4. replica's own VACUUM sets it
                # (merge.vacuum_files); this is for the others, e.g. a VACUUM in SQL.
                "spark.sql.sources.parallelPartitionDiscovery.parallelism": "4",
                "spark.driver.memory": "2g",
            }
        )
    return conf


#: How many tasks Delta rebuilds a table's state in (its default: 50).
SNAPSHOT_PARTITIONS = "spark.databricks.delta.snapshotPartitions"

#: Settings that choose a catalog: when the user gives any of them, the local default is not applied.
CATALOG_SETTINGS = ("spark.sql.catalogImplementation", "spark.hadoop.hive.metastore.uris")
HIVE = "hive"
_DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"


def catalog_conf(settings: LocalSettings) -> dict[str, str]:
    """The local default catalog: a Hive metastore on embedded Derby in ``<catalog>/metastore`` (created on first
    use), its warehouse beside it. Tables of replicas are external (their data stays where the replica wrote it)."""
    home = settings.catalog_home
    return {
        "spark.sql.catalogImplementation": HIVE,
        "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={home / 'metastore'};create=true",
        "spark.hadoop.datanucleus.schema.autoCreateAll": "true",
        "spark.hadoop.hive.metastore.schema.verification": "false",
        "spark.sql.warehouse.dir": str(home / "warehouse"),
    }


def _launch_settings(launch: Mapping[str, str]) -> dict[str, str] | None:
    """The settings this driver was launched with (spark-submit's ``--conf``, spark-defaults.conf); None when
    joining a running session, whose settings are made.

    Asking needs the JVM, so it is started here with the session's other settings (``launch``): its packages are
    resolved at its start, as they would be by ``getOrCreate``.
    """
    from pyspark import SparkConf, SparkContext

    if SparkContext._active_spark_context is not None:
        return None
    settings = SparkConf(loadDefaults=False)
    for key, value in launch.items():
        settings.set(key, value)
    SparkContext._ensure_initialized(conf=settings)  # the JVM, with spark-submit's settings as system properties
    return dict(SparkConf().getAll())


def _catalog_given(given: Mapping[str, str] | None) -> bool:
    """Whether the launch settings (:func:`_launch_settings`) already chose a catalog for this driver."""
    if given is None:  # joining a running session: its catalog is set
        return True
    return (
        any(key in given for key in CATALOG_SETTINGS)
        or given.get("spark.sql.catalog.spark_catalog", _DELTA_CATALOG) != _DELTA_CATALOG
    )


def launch_scheduler(conf: Mapping[str, str], given: Mapping[str, str] | None) -> dict[str, str]:
    """``conf`` without its scheduler settings where the launch set any of :data:`SCHEDULER_SETTINGS` otherwise: a
    user's own ``--conf spark.scheduler.mode`` or pool file is kept as given (a fold then shares the cores by it).

    ``given`` holds ``conf``'s own values too when this process launched the JVM with them.
    """
    theirs = {
        key: given[key]
        for key in SCHEDULER_SETTINGS
        if given is not None and given.get(key, conf.get(key)) != conf.get(key)
    }
    if not theirs:
        return dict(conf)
    own = ", ".join(f"{key}={value}" for key, value in theirs.items())
    logger.info("Spark's scheduler settings are the launch's own (%s): a fold shares the cores by them", own)
    return {key: value for key, value in conf.items() if key not in SCHEDULER_SETTINGS}


def java_class(spark: SparkSession, name: str) -> Any:
    """The JVM class ``name`` (fully qualified), in one py4j call.

    ``jvm.org.apache.hadoop.fs.Path`` asks the JVM about ``org``, ``org.apache``, … in turn, and each name that is not
    a class is looked for in every jar of the class path and under each of PySpark's imports: about 4 ms, against
    0.5 ms for the whole name at once.
    """
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    return getattr(jvm, name)


def launch_own(conf: Mapping[str, str], given: Mapping[str, str] | None) -> dict[str, str]:
    """``conf`` with the launch's own values of :data:`LAUNCH_OWN` where it set any (``given`` as for
    :func:`launch_scheduler`)."""
    if given is None:
        return dict(conf)
    return {**conf, **{key: given[key] for key in LAUNCH_OWN if key in given}}


def persistent_catalog(spark: SparkSession) -> bool:
    """Whether names created in this session outlive it (a Hive metastore or a catalog of the user's own)."""
    implementation = spark.conf.get("spark.sql.catalogImplementation", "in-memory")
    return implementation == HIVE or spark.conf.get("spark.sql.catalog.spark_catalog", _DELTA_CATALOG) != _DELTA_CATALOG


def local_metastore(spark: SparkSession, settings: LocalSettings) -> bool:
    """Whether this session's catalog is the local default (embedded Derby, one JVM at a time)."""
    url = catalog_conf(settings)["spark.hadoop.javax.jdo.option.ConnectionURL"]
    return persistent_catalog(spark) and spark.conf.get("spark.hadoop.javax.jdo.option.ConnectionURL", "") == url


#: What Spark's JVM prints at every start that tells a user nothing: Ivy's report of the packages it resolved from
#: its cache (about 60 lines), Spark's log4j banner, and warnings of every local run and of the local catalog
#: that ask nothing of anyone. What Ivy says of a
#: download or of a dependency it could not resolve, and every other line, passes.
_JVM_NOISE = re.compile(
    r"^(:: (loading settings|resolving dependencies|resolution report|retrieving) :: "
    r"|Ivy Default Cache set to: |The jars for the packages stored in: "
    r"|\S+#\S+ added as a dependency$"
    r"|\t(confs: \[|found \S+ in \S+$|:: evicted modules:$|-+$|\|.*\|$)"
    r"|\t\S+ (by \[[^]]*\] |transitively )in \[\w+\]$"
    r"|\t\d+ artifacts copied, \d+ already retrieved"
    r"|Using Spark's default log4j profile: |Setting default log level to \"WARN\"\.$"
    r"|To adjust logging level use sc\.setLogLevel|WARNING: Using incubator modules: jdk\.incubator\.vector$"
    r"|.* WARN NativeCodeLoader: Unable to load native-hadoop library"
    r"|.* WARN SparkStringUtils: Truncated the string representation of a plan"
    # Every streaming query's start: Spark itself runs a stream's micro-batches without adaptive execution.
    r"|.* WARN ResolveWriteToStream: spark\.sql\.adaptive\.enabled is not supported in streaming DataFrames"
    # A stream stopped between two jobs: Spark finds no job of its group to cancel.
    r"|.* WARN DAGScheduler: Failed to cancel job group \S+\. Cannot find active jobs for it\.$"
    # Every MERGE of a batch's winners: they are broadcast to the scan for the files they touch, and Delta's rewrite
    # (an outer join that keeps the winners) cannot take the hint.
    r"|.* WARN HintErrorLogger: Hint \(strategy=broadcast\) is not supported in the query: "
    r"build left for (full|left) outer join\.$"
    # A MERGE whose winners match no row (every key new, or deleted before; a merge-on-read table's first fold into
    # its empty base): Delta joins them to no file, and Spark drops that join with the winners' hint. Every hint is
    # the replica's own, for speed only.
    r"|.* WARN HintErrorLogger: A join hint \(strategy=broadcast\) is specified but it is not part of a join "
    r"relation\.$"
    # Delta's MERGE of maintenance (the superseded retained deletes) unpersisting the copy of its source it made.
    r"|.* WARN MapPartitionsRDD: RDD \d+ was locally checkpointed, its lineage has been truncated and cannot be "
    r"recomputed after unpersisting$"
    # Every VACUUM's count (Delta prints it), which maintenance's own line for the table gives too.
    r"|Deleted \d+ files and directories in a total of \d+ directories\.$"
    # Every fold's retirement of changes from a change log, whose appends keep no row counts.
    r"|.* WARN DeleteCommand: Could not validate number of records due to missing statistics\.$"
    # The local catalog (a Hive metastore) on every start, and for every Delta table it registers:
    r"|.* WARN HiveExternalCatalog: Couldn't find corresponding Hive SerDe for data source provider delta\."
    r"|.* WARN SessionState: METASTORE_FILTER_HOOK will be ignored"
    r"|.* WARN HiveConf: HiveConf of name hive\.internal\.ss\.authz\.settings\.applied\.marker does not exist)"
)


def _forward(source: int, sink: int) -> None:
    """Copy the JVM's output to our stderr, line by line, without the lines of :data:`_JVM_NOISE`."""
    with os.fdopen(source, "rb") as lines, os.fdopen(sink, "wb", buffering=0) as out:
        for line in lines:
            if not _JVM_NOISE.match(line.decode("utf-8", "replace")):
                with contextlib.suppress(OSError):
                    out.write(line)


@contextlib.contextmanager
def _quiet_jvm() -> Iterator[None]:
    """Start Spark's JVM (inside the block) with its output through a thread that drops its start-up noise.

    The JVM inherits the process's stdout and stderr when pyspark starts it; for that moment both are a pipe read
    by a daemon thread, which copies what the JVM writes to stderr, for as long as it runs. So stdout carries only
    what the job itself prints (Ivy writes its first line to the JVM's stdout, which would precede a command's
    ``--json``), and this process's own streams are put back at once, never delayed or reordered.
    """
    from pyspark import SparkContext

    if SparkContext._gateway is not None:  # the JVM runs already: nothing is started here
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    source, pipe = os.pipe()
    threading.Thread(target=_forward, args=(source, os.dup(2)), name="replica-jvm-output", daemon=True).start()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    for fd in saved:
        os.dup2(pipe, fd)
    os.close(pipe)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in saved.items():
            os.dup2(original, fd)
            os.close(original)


def build_session(
    app_name: str,
    settings: LocalSettings,
    master: str | None = None,
    ui: bool = False,
    extra: Mapping[str, str] | None = None,
    catalog: bool = False,
) -> SparkSession:
    """Build (or join) the SparkSession. ``master=None`` keeps what spark-submit chose.

    ``catalog``: the session needs names that outlive it; unless a catalog was chosen by Spark's settings, it gets
    the local default (:func:`catalog_conf`). Without it, the session keeps Spark's own default (in memory).
    """
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    conf = {**session_conf(settings, master, ui), **dict(extra or {})}
    launch = {**conf, "spark.app.name": app_name, **({"spark.master": master} if master else {})}
    with _quiet_jvm():
        given = _launch_settings(launch)
    conf = launch_own(launch_scheduler(conf, given), given)
    if catalog and not _catalog_given(given):
        conf = {**conf, **catalog_conf(settings), **dict(extra or {})}
    for key, value in conf.items():
        builder = builder.config(key, value)
    try:
        with _quiet_jvm():
            spark = builder.getOrCreate()
    except Exception as exc:  # the JVM did not start: Java or the first jar download are the usual causes
        raise SetupError(
            f"Spark could not start ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}). On a first "
            f"run this is usually the download of {', '.join(artifacts.SPARK_PACKAGES)} from Maven Central: "
            f"look for 'unresolved dependency' above, check network or proxy access, and retry (jars are cached "
            f"in {settings.state_dir / 'ivy'} after one success). Otherwise check Java 17+ (JAVA_HOME)."
        ) from exc
    spark.sparkContext.setLogLevel("WARN")
    # A local launch set it; on a cluster the job's own reads of Delta state (a verify's) take one task per core too.
    if spark.conf.get(SNAPSHOT_PARTITIONS, None) is None:
        spark.conf.set(SNAPSHOT_PARTITIONS, snapshot_partitions(spark))
    _record_resolved(spark, settings)
    if local_metastore(spark, settings):  # Derby writes derby.log in the working folder unless told otherwise
        jvm = spark.sparkContext._jvm
        assert jvm is not None
        (settings.catalog_home / "metastore").parent.mkdir(parents=True, exist_ok=True)
        jvm.java.lang.System.setProperty("derby.stream.error.file", str(settings.catalog_home / "derby.log"))
    logger.info("Spark %s session %r ready (master %s)", spark.version, app_name, spark.sparkContext.master)
    return spark


def _record_resolved(spark: SparkSession, settings: LocalSettings) -> None:
    """A local driver whose start resolved packages records the jars for the next starts (see artifacts).

    The JVM's system properties hold what spark-submit resolved, whichever of its options or the session's named
    the packages (the session's configuration shows the latter only)."""
    jvm = spark.sparkContext._jvm
    if jvm is None or not (spark.sparkContext.master or "").startswith("local"):
        return
    system = jvm.java.lang.System
    packages = system.getProperty("spark.jars.packages")
    if packages:
        with contextlib.suppress(OSError):  # a read-only cache: the next start resolves again
            artifacts.record_resolved(packages, system.getProperty("spark.jars") or "", settings.state_dir / "ivy")


def _stopped_jvm_noise(record: logging.LogRecord) -> bool:
    """False for py4j's report of a command that failed on its connection, once this process stops the JVM.

    py4j logs such a failure with its stack trace on the root logger (``logging.exception``), and a command in flight
    as the JVM exits (a finalizer releasing a JVM object) fails so: the caller of a command still gets its error.
    """
    return not (record.name == "root" and "py4j" in Path(record.pathname).parts)


def stop_session(spark: SparkSession, timeout_s: float = 60.0) -> None:
    """Stop the session and, when this process started Spark's JVM, wait until it has exited.

    The JVM outlives ``stop()`` until it notices that its Python driver is gone; with the local catalog open, Derby's
    lock goes only with it. A process that held the catalog waits here so that the next one can open it at once.
    """
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    logging.getLogger().addFilter(_stopped_jvm_noise)
    spark.stop()
    proc = getattr(gateway, "proc", None)
    if proc is None or proc.stdin is None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.close()  # Spark's Python gateway exits when its input ends
    proc.wait(timeout=timeout_s)
    SparkContext._gateway = None
    SparkContext._jvm = None


def batch_confs(spark: SparkSession) -> dict[str, str]:
    """Confs of the replica's own session (each batch also sizes its shuffles: see ``batch._size_for``).

    MERGE sources are ``localCheckpoint``s of the batch's winners (deterministic, already materialized), so Delta
    need not materialize them again. Delta rebuilds a table's state in 50 tasks unless told otherwise; with the
    batch's adaptive execution off nothing coalesces them, so on a cluster of fewer cores the replica's session
    uses one task per core (a setting the user gave is kept).
    """
    return {
        "spark.databricks.delta.merge.materializeSource": "none",
        # A new session starts from the launch's settings: the user's value, or the one build_session chose, is
        # carried over.
        SNAPSHOT_PARTITIONS: spark.conf.get(SNAPSHOT_PARTITIONS, None) or snapshot_partitions(spark),
    }


def snapshot_partitions(spark: SparkSession) -> str:
    """Tasks for Delta's rebuild of a table's state: one per core up to Delta's 50. Delta caches the state in that
    many partitions, which nothing coalesces afterwards: a verify on a two-core cluster ran 500 one-row tasks."""
    return str(min(50, max(1, spark.sparkContext.defaultParallelism)))


#: How a streaming query writes its checkpoint's files (offsets, commits): Spark's default renames each through
#: Hadoop's FileContext, which on a local disk asks for the file's link status, and Hadoop without its native
#: library answers that by starting a ``readlink`` process (with a ``chmod`` for each new file): 8-10 ms each here,
#: about 35 in a replica's run of one batch (start, batch, stop) and a few in every batch after. The FileSystem-based
#: manager renames without them; its rename is not atomic against a second writer of the same checkpoint, which on
#: a local disk the checkpoint's lock (``replica_lib.recovery.lock_checkpoint``) rules out.
CHECKPOINT_FILE_MANAGER = "spark.sql.streaming.checkpointFileManagerClass"
FILE_SYSTEM_CHECKPOINT_FILES = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)


def replica_session(spark: SparkSession, local_checkpoint: bool = False) -> SparkSession:
    """A session beside ``spark`` (same Spark context) for a replica's writes: its SQL confs are its own, so the
    Delta write confs of an idempotent commit (``replica_lib.merge.idempotent``) reach no other session's commits.

    ``local_checkpoint``: the replica's checkpoint is on a local disk, under its lock (see
    :data:`CHECKPOINT_FILE_MANAGER`; a manager the user gave is kept)."""
    session = spark.newSession()
    for key, value in batch_confs(spark).items():
        session.conf.set(key, value)
    if local_checkpoint and spark.conf.get(CHECKPOINT_FILE_MANAGER, None) is None:
        session.conf.set(CHECKPOINT_FILE_MANAGER, FILE_SYSTEM_CHECKPOINT_FILES)
    return session
