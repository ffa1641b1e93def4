"""The JVM packages a replica job needs beyond pyspark, pinned with the Python dependencies in pyproject.toml.

Spark resolves them itself through ``--packages`` (``spark-submit.sh``) or ``spark.jars.packages``
(:func:`replica_lib.session.build_session`), with ``resources/ivysettings.xml`` (Maven Central only) and a cache
under ``<state>/ivy``, so after the first run everything works offline.
"""

from __future__ import annotations

from pathlib import Path

SPARK_VERSION = "4.0.0"
SCALA_BINARY = "2.13"
DELTA_VERSION = "4.0.0"

#: What Spark needs beyond pyspark: Delta and Spark's own Kafka source, for the same Spark and Scala version.
SPARK_PACKAGES: tuple[str, ...] = (
    f"io.delta:delta-spark_{SCALA_BINARY}:{DELTA_VERSION}",
    f"org.apache.spark:spark-sql-kafka-0-10_{SCALA_BINARY}:{SPARK_VERSION}",
)

RESOURCES = Path(__file__).resolve().parent / "resources"
IVY_SETTINGS = RESOURCES / "ivysettings.xml"


def packages_for(job_file: str) -> tuple[str, ...]:
    """The ``--packages`` for a user job (``spark-submit.sh`` asks; dev jobs add theirs in ``replica_dev``)."""
    del job_file  # every user job needs the same packages
    return SPARK_PACKAGES
