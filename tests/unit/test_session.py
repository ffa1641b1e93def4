"""replica_lib.session: what of the JVM's start-up output a user sees, and the settings a replica's session gets."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

from pyspark.sql import SparkSession

import replica_lib
from replica_lib.config import LocalSettings
from replica_lib.session import (
    _JVM_NOISE,
    CONSOLE_LOG,
    JAVA_OPTIONS,
    JAVA_OPTIONS_SETTINGS,
    KAFKA_CONSUMERS,
    PYTHON_DEBUGGING,
    SCHEDULER_POOLS,
    SNAPSHOT_PARTITIONS,
    _stopped_jvm_noise,
    driver_java_options,
    launch_own,
    launch_scheduler,
    replica_session,
    scheduler_pools,
)

#: What spark-submit printed at the start of ./replica status, its packages already in the cache (abridged).
START_UP = """\
WARNING: Using incubator modules: jdk.incubator.vector
:: loading settings :: file = /work/replica_lib/resources/ivysettings.xml
:: loading settings :: url = jar:file:/v/pyspark/jars/ivy-2.5.3.jar!/org/apache/ivy/core/settings/ivysettings.xml
Ivy Default Cache set to: /work/.state/ivy/cache
The jars for the packages stored in: /work/.state/ivy/jars
io.delta#delta-spark_4.2_2.13 added as a dependency
org.apache.spark#spark-sql-kafka-0-10_2.13 added as a dependency
:: resolving dependencies :: org.apache.spark#spark-submit-parent-38ca697e-1719-4cac-8970-f26da7118f9b;1.0
\tconfs: [default]
\tfound io.delta#delta-spark_4.2_2.13;4.4.0 in central
\tfound org.apache.kafka#kafka-clients;3.9.2 in central
:: resolution report :: resolve 1351ms :: artifacts dl 22ms
\t:: evicted modules:
\torg.slf4j#slf4j-api;2.0.17 by [org.slf4j#slf4j-api;2.0.13] in [default]
\tcommons-logging#commons-logging;1.3.0 transitively in [default]
\t---------------------------------------------------------------------
\t|                  |            modules            ||   artifacts   |
\t|       conf       | number| search|dwnlded|evicted|| number|dwnlded|
\t|      default     |   47  |   0   |   0   |   9   ||   38  |   0   |
:: retrieving :: org.apache.spark#spark-submit-parent-38ca697e-1719-4cac-8970-f26da7118f9b
\t0 artifacts copied, 38 already retrieved (0kB/19ms)
26/11/25 20:27:20 WARN NativeCodeLoader: Unable to load native-hadoop library for your platform... using builtin
Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties
Setting default log level to "WARN".
To adjust logging level use sc.setLogLevel(newLevel). For SparkR, use setLogLevel(newLevel).
26/11/25 20:27:32 WARN SparkStringUtils: Truncated the string representation of a plan since it was too large.
26/11/25 20:34:56 WARN HiveExternalCatalog: Couldn't find corresponding Hive SerDe for data source provider delta. \
Persisting data source table `spark_catalog`.`orders_a`.`orders__raw` into Hive metastore in Spark SQL specific format.
26/11/25 20:34:56 WARN SessionState: METASTORE_FILTER_HOOK will be ignored, since hive.security.authorization.manager
26/11/25 20:34:56 WARN HiveConf: HiveConf of name hive.internal.ss.authz.settings.applied.marker does not exist
"""

#: What Spark and Delta print of every stream's start and stop, every MERGE (one that matches no row too), every fold
#: and maintenance's MERGE and VACUUM, asking nothing of anyone.
RUN = """\
26/12/06 03:13:55 WARN ResolveWriteToStream: spark.sql.adaptive.enabled is not supported in streaming \
DataFrames/Datasets and will be disabled.
26/12/06 02:25:49 WARN DAGScheduler: Failed to cancel job group 0ff1a10b-f98d-4109-ad65-51624ef66120. Cannot find \
active jobs for it.
26/12/06 01:55:42 WARN HintErrorLogger: Hint (strategy=broadcast) is not supported in the query: build left for full \
outer join.
26/12/06 01:55:42 WARN HintErrorLogger: Hint (strategy=broadcast) is not supported in the query: build left for left \
outer join.
26/12/06 01:55:43 WARN DeleteCommand: Could not validate number of records due to missing statistics.
26/12/06 08:13:50 WARN HintErrorLogger: A join hint (strategy=broadcast) is specified but it is not part of a join \
relation.
26/12/06 08:11:40 WARN MapPartitionsRDD: RDD 505 was locally checkpointed, its lineage has been truncated and cannot \
be recomputed after unpersisting
Deleted 5 files and directories in a total of 1 directories.
"""

#: What must still reach the user: a download in progress, a dependency Ivy could not resolve, any other warning.
KEPT = """\
downloading https://repo1.maven.org/maven2/io/delta/delta-spark_4.2_2.13/4.4.0/delta-spark_4.2_2.13-4.4.0.jar ...
\t[SUCCESSFUL ] io.delta#delta-spark_4.2_2.13;4.4.0!delta-spark_4.2_2.13.jar (812ms)
\t\t::::::::::::::::::::::::::::::::::::::::::::::
\t\t::          UNRESOLVED DEPENDENCIES         ::
\t\t:: io.delta#delta-spark_4.2_2.13;9.9.9: not found
:: USE VERBOSE OR DEBUG MESSAGE LEVEL FOR MORE DETAILS
Exception in thread "main" java.lang.RuntimeException: [unresolved dependency: io.delta#delta-spark_4.2_2.13;9.9.9]
26/11/25 20:27:40 WARN KafkaDataConsumer: KafkaDataConsumer is not running in UninterruptibleThread.
26/12/06 01:55:42 WARN HintErrorLogger: Hint (strategy=broadcast) is not supported in the query: build left for \
right outer join in the user's own query.
"""


def test_the_start_up_report_is_dropped() -> None:
    kept = [line for line in START_UP.splitlines(keepends=True) if not _JVM_NOISE.match(line)]
    assert kept == []


def test_what_every_stream_merge_and_fold_prints_is_dropped() -> None:
    kept = [line for line in RUN.splitlines(keepends=True) if not _JVM_NOISE.match(line)]
    assert kept == []


def test_downloads_failures_and_other_warnings_pass() -> None:
    dropped = [line for line in KEPT.splitlines(keepends=True) if _JVM_NOISE.match(line)]
    assert dropped == []


def test_the_scheduler_pools_are_a_file_spark_can_read_also_from_a_zipped_package(tmp_path: Path) -> None:
    """A cluster job ships replica_lib zipped (--py-files): the pool file inside the zip is written out."""
    package = Path(replica_lib.__file__).parent
    archive = tmp_path / "replica_lib.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for path in package.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                zipped.write(path, str(path.relative_to(package.parent)))
    script = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "import replica_lib.session as s; from replica_lib.config import LocalSettings; "
        "print(s.__file__); print(s.scheduler_pools(LocalSettings(state_dir=Path(sys.argv[2]), java_home=None)))"
    )
    command = [sys.executable, "-c", script, str(archive), str(tmp_path / "state")]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    module, pools = run.stdout.split()
    assert module.startswith(str(archive))
    assert Path(pools) == tmp_path / "state" / "spark" / "fairscheduler.xml"
    assert Path(pools).read_text() == SCHEDULER_POOLS.read_text()
    assert scheduler_pools(LocalSettings(state_dir=tmp_path / "other", java_home=None)) == SCHEDULER_POOLS


def test_the_scheduler_settings_a_launch_gives_are_kept_as_given() -> None:
    ours = {"spark.scheduler.mode": "FAIR", "spark.scheduler.allocation.file": "/ours.xml", "spark.ui.enabled": "false"}
    assert launch_scheduler(ours, {"spark.master": "local[2]"}) == ours
    assert launch_scheduler(ours, None) == ours  # joining a running session: what it was given is set already
    assert launch_scheduler(ours, ours) == ours  # the JVM launched here, with these
    for given in ({"spark.scheduler.mode": "FIFO"}, {"spark.scheduler.allocation.file": "/theirs.xml"}):
        assert launch_scheduler(ours, given) == {"spark.ui.enabled": "false"}  # neither of ours: theirs stand


def test_python_call_sites_are_not_captured_unless_the_launch_asks(spark: SparkSession) -> None:
    from pyspark.errors.utils import is_debugging_enabled

    assert spark.conf.get(PYTHON_DEBUGGING) == "false" and not is_debugging_enabled()  # the run's session
    ours = {PYTHON_DEBUGGING: "false", "spark.ui.enabled": "false"}
    assert launch_own(ours, {"spark.master": "local[2]"}) == launch_own(ours, None) == ours
    assert launch_own(ours, {PYTHON_DEBUGGING: "true"}) == {**ours, PYTHON_DEBUGGING: "true"}


def test_spark_keeps_a_kafka_consumer_for_each_partition_of_large_topics(spark: SparkSession) -> None:
    """Spark keeps 64 by default; past that it closes and reopens consumers at every task, with a warning each time
    (tests/integration/test_jobs.py reads 80 partitions without one)."""
    assert spark.sparkContext.getConf().get(KAFKA_CONSUMERS) == "1024"
    ours = {KAFKA_CONSUMERS: "1024", "spark.ui.enabled": "false"}
    assert launch_own(ours, {"spark.master": "local[2]"}) == ours
    assert launch_own(ours, {KAFKA_CONSUMERS: "200"}) == {**ours, KAFKA_CONSUMERS: "200"}  # the launch's own stands


def test_the_jit_compiles_methods_of_any_size_unless_the_launch_says_otherwise(spark: SparkSession) -> None:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    arguments = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert JAVA_OPTIONS in arguments  # the run's own driver
    assert spark.sparkContext.getConf().get("spark.executor.defaultJavaOptions") == JAVA_OPTIONS
    ours = {key: JAVA_OPTIONS for key in JAVA_OPTIONS_SETTINGS}
    assert launch_own(ours, None) == launch_own(ours, {"spark.master": "local[2]"}) == ours
    theirs = {"spark.executor.defaultJavaOptions": "-Xss4m"}  # an administrator's spark-defaults.conf
    assert launch_own(ours, theirs) == {**ours, **theirs}


def test_the_drivers_console_log_gives_a_record_one_line_unless_traces_are_asked_for(
    spark: SparkSession, settings: LocalSettings
) -> None:
    """A job that fails says so in one line; Spark's records of the failure on the way are one line each (a
    message's first line, its exception's), not stack traces. REPLICA_DEBUG starts the driver with Spark's log."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    arguments = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert f"-Dlog4j2.configurationFile={CONSOLE_LOG}" in arguments  # the run's own driver
    assert driver_java_options(settings) == f"{JAVA_OPTIONS} -Dlog4j2.configurationFile={CONSOLE_LOG}"
    assert driver_java_options(dataclasses.replace(settings, debug=True)) == JAVA_OPTIONS

    log4j = jvm.org.apache.logging.log4j
    layout = log4j.LogManager.getContext(False).getConfiguration().getAppender("console").getLayout()
    failure = jvm.java.lang.RuntimeException("[TASK_WRITE_FAILED] boom\nsecond line", jvm.java.lang.Error("cause"))
    event = (
        log4j.core.impl.Log4jLogEvent.newBuilder()
        .setLoggerName("org.apache.spark.executor.Executor")
        .setLevel(log4j.Level.ERROR)
        .setMessage(log4j.message.SimpleMessage("Exception in task 0.0\nat a frame"))
        .setThrown(failure)
        .build()
    )
    line = layout.toSerializable(event)
    assert line.endswith(
        " ERROR Executor: Exception in task 0.0 (java.lang.RuntimeException: [TASK_WRITE_FAILED] boom)\n"
    )
    assert line.count("\n") == 1
    plain = log4j.core.impl.Log4jLogEvent.newBuilder().setLoggerName("org.apache.spark.Some").setLevel(log4j.Level.WARN)
    assert layout.toSerializable(plain.setMessage(log4j.message.SimpleMessage("no exception")).build()).endswith(
        " WARN Some: no exception\n"
    )


def test_a_replica_session_keeps_the_snapshot_tasks_its_parent_was_given(spark: SparkSession) -> None:
    """A new session starts from the launch's settings, not its parent's: the value set on the parent (by the user, or
    by build_session on a cluster) must reach the replica's session, whose Delta state it sizes."""
    before = spark.conf.get(SNAPSHOT_PARTITIONS, None)
    try:
        spark.conf.set(SNAPSHOT_PARTITIONS, "3")
        assert spark.newSession().conf.get(SNAPSHOT_PARTITIONS, None) != "3"  # what the copy is for
        assert replica_session(spark).conf.get(SNAPSHOT_PARTITIONS) == "3"
    finally:
        if before is None:
            spark.conf.unset(SNAPSHOT_PARTITIONS)
        else:
            spark.conf.set(SNAPSHOT_PARTITIONS, before)


def test_py4j_failures_on_the_root_logger_are_dropped_once_the_jvm_is_stopped_and_nothing_else() -> None:
    import py4j.java_gateway

    py4j_file = py4j.java_gateway.__file__

    def record(name: str, pathname: str) -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, pathname, 1060, "Exception while sending command.", None, None)

    assert not _stopped_jvm_noise(record("root", py4j_file))
    assert _stopped_jvm_noise(record("root", __file__))  # another root record
    assert _stopped_jvm_noise(record("replica_lib.batch", __file__))
    assert _stopped_jvm_noise(record("py4j.java_gateway", py4j_file))  # py4j's own logger: its handlers decide
