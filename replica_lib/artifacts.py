"""The JVM packages a replica job needs beyond pyspark, derived from the pinned Python packages.

``pyproject.toml`` pins ``pyspark`` and ``delta-spark``, and nothing else names a version: Spark's Kafka source is
Spark's own version, and Delta's jar is the delta-spark release built for that Spark (its artifact names the Spark
minor version and Scala's). Spark resolves them itself through ``--packages`` (``spark-submit.sh``) or
``spark.jars.packages`` (:func:`replica_lib.session.build_session`), with ``resources/ivysettings.xml`` (Maven
Central only) and a cache under ``<state>/ivy``, so after the first run everything works offline.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

SCALA_BINARY = "2.13"


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:  # pragma: no cover - the project's install always has both
        return "0.0.0"


#: The Spark and Delta releases in use: those of the installed ``pyspark`` and ``delta-spark``.
SPARK_VERSION = _installed("pyspark")
DELTA_VERSION = _installed("delta-spark")
SPARK_MINOR = ".".join(SPARK_VERSION.split(".")[:2])

#: What Spark needs beyond pyspark: Delta and Spark's own Kafka source, for the same Spark and Scala version.
SPARK_PACKAGES: tuple[str, ...] = (
    f"io.delta:delta-spark_{SPARK_MINOR}_{SCALA_BINARY}:{DELTA_VERSION}",
    f"org.apache.spark:spark-sql-kafka-0-10_{SCALA_BINARY}:{SPARK_VERSION}",
)

RESOURCES = Path(__file__).resolve().parent / "resources"
IVY_SETTINGS = RESOURCES / "ivysettings.xml"


def packages_for(job_file: str) -> tuple[str, ...]:
    """The ``--packages`` for a user job (``spark-submit.sh`` asks; dev jobs add theirs in ``replica_dev``)."""
    del job_file  # every user job needs the same packages
    return SPARK_PACKAGES


def driver_classpath(job_file: str, ivy_dir: Path) -> tuple[str, ...]:
    """Jars a job needs on the driver JVM's own class path (``--driver-class-path``), from the ``--packages`` cache.

    Only the SQL server (``jobs/serve.py``): Hive builds each JDBC session's class loader on the JVM's class path,
    where the jars of ``--packages`` are not, so its sessions could not load Delta's catalog otherwise.
    """
    if Path(job_file).name != "serve.py":
        return ()
    return tuple(str(jar) for jar in sorted((ivy_dir / "jars").glob(f"io.delta_*-{DELTA_VERSION}.jar")))
