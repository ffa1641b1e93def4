"""The JVM packages a replica job needs beyond pyspark, derived from the pinned Python packages.

``pyproject.toml`` pins ``pyspark`` and ``delta-spark``, and nothing else names a version: Spark's Kafka source is
Spark's own version, and Delta's jar is the delta-spark release built for that Spark (its artifact names the Spark
minor version and Scala's). Spark resolves them itself through ``--packages`` (``spark-submit.sh``) or
``spark.jars.packages`` (:func:`replica_lib.session.build_session`), with ``resources/ivysettings.xml`` (Maven
Central only) and a cache under ``<state>/ivy``, so after the first run everything works offline.

**Resolved once.** Ivy resolves ``--packages`` at every start, even from a warm cache: about 1.5 s of a local job's
start. A local driver that did resolve them records the jars Ivy chose (:func:`record_resolved`, called by
``build_session``); later local starts with the same packages and Ivy settings pass those jars instead
(:func:`resolved_jars`), as long as every one of them is still in the cache. A cluster's driver resolves as before.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

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


def _record(ivy_dir: Path, packages: Sequence[str]) -> Path:
    """Where the jars resolved for ``packages`` are recorded: named by the packages and the Ivy settings' text."""
    key = hashlib.sha256(",".join(sorted(packages)).encode() + b"\0" + IVY_SETTINGS.read_bytes()).hexdigest()[:16]
    return ivy_dir / "resolved" / f"{key}.txt"


def resolved_jars(packages: Sequence[str], ivy_dir: Path) -> tuple[str, ...]:
    """The jars Ivy resolved for ``packages`` at an earlier local start; empty when there is no record or one of its
    jars is gone from the cache (the next start resolves them again)."""
    try:
        jars = tuple(_record(ivy_dir, packages).read_text().split())
    except OSError:
        return ()
    return jars if jars and all(Path(jar).is_file() for jar in jars) else ()


def record_resolved(packages: str, jars: str, ivy_dir: Path) -> None:
    """Record what a driver's Ivy resolved: ``packages`` and ``jars`` as spark-submit set them (``spark.jars.packages``
    and ``spark.jars``); only the jars in the cache count (``--jars`` of the user's are not the packages')."""
    names = tuple(p.strip() for p in packages.split(",") if p.strip())
    cache = (ivy_dir / "jars").resolve()
    paths = [unquote(urlparse(uri).path) if uri.startswith("file:") else uri for uri in jars.split(",") if uri]
    cached = [path for path in paths if Path(path).parent.resolve() == cache]
    if not names or not cached or resolved_jars(names, ivy_dir):
        return
    record = _record(ivy_dir, names)
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text("\n".join(cached) + "\n")
    partial.replace(record)  # whole or absent, whichever start reads it
