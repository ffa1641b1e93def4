"""The one place that builds a SparkSession: Delta, Spark's Kafka source, and the project's jar cache."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pyspark.sql import SparkSession

from replica_lib import artifacts
from replica_lib.config import LocalSettings
from replica_lib.errors import SetupError

logger = logging.getLogger(__name__)


#: Spark keeps 100 compiled query classes by default; one micro-batch (decoding, ordering, Delta's MERGE, its
#: snapshot and data-skipping queries) needs more, so with 100 every batch compiled ~100 classes again (~1 s of
#: a 5 s batch). Static: it must be set before the session starts.
CODEGEN_CACHE = {"spark.sql.codegen.cache.maxEntries": "2000"}


def session_conf(settings: LocalSettings, master: str | None, ui: bool) -> dict[str, str]:
    """Spark configuration for replica jobs; under ``spark-submit.sh`` most of it is already set."""
    conf = {
        "spark.jars.packages": ",".join(artifacts.SPARK_PACKAGES),
        "spark.jars.ivy": str(settings.state_dir / "ivy"),
        "spark.jars.ivySettings": str(artifacts.IVY_SETTINGS),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "true" if ui else "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.streaming.stopGracefullyOnShutdown": "true",
        # A replica's writes are its own: no surprise schema evolution, no retention-check bypass.
        "spark.databricks.delta.schema.autoMerge.enabled": "false",
        **CODEGEN_CACHE,
    }
    if master is not None and master.startswith("local"):
        conf.update(
            {
                "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
                "spark.sql.shuffle.partitions": "4",
                "spark.default.parallelism": "4",
                # Delta rebuilds a table's snapshot with 50 tasks by default: minutes of overhead on 2 cores.
                "spark.databricks.delta.snapshotPartitions": "2",
                "spark.driver.memory": "2g",
            }
        )
    return conf


def build_session(
    app_name: str,
    settings: LocalSettings,
    master: str | None = None,
    ui: bool = False,
    extra: Mapping[str, str] | None = None,
) -> SparkSession:
    """Build (or join) the SparkSession. ``master=None`` keeps what spark-submit chose."""
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    for key, value in {**session_conf(settings, master, ui), **dict(extra or {})}.items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # the JVM did not start: Java or the first jar download are the usual causes
        raise SetupError(
            f"Spark could not start ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}). On a first "
            f"run this is usually the download of {', '.join(artifacts.SPARK_PACKAGES)} from Maven Central: "
            f"look for 'unresolved dependency' above, check network or proxy access, and retry (jars are cached "
            f"in {settings.state_dir / 'ivy'} after one success). Otherwise check Java 17+ (JAVA_HOME)."
        ) from exc
    spark.sparkContext.setLogLevel("WARN")
    logger.info("Spark %s session %r ready (master %s)", spark.version, app_name, spark.sparkContext.master)
    return spark
