"""Load the classes replica jobs use, in a JVM that archives them as it exits (run by spark-submit.sh, once).

``spark-submit.sh`` starts every local driver's JVM with ``-XX:SharedArchiveFile``: the JVM maps the classes from the
archive instead of reading and verifying them from the jars, about 4 s of a 19 s start. The archive (about 200 MB,
in ``.state/class-archive``) is made by this job under ``-XX:ArchiveClassesAtExit``, once per Java and pyspark
(``replica_class_archive`` in ``scripts/bootstrap.sh``); it holds what this job loaded: the session and Delta's
reads and writes, most of what a job's start loads. Classes not archived are read from the jars as before.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from delta.tables import DeltaTable
from pyspark.sql import SparkSession

from replica_lib.config import local_settings
from replica_lib.errors import SetupError
from replica_lib.session import build_session


def _load_classes(spark: SparkSession, work: Path) -> None:
    """A short life of a Delta table with deletion vectors: write, MERGE, OPTIMIZE, read."""
    path = str(work / "table")
    rows = spark.range(200).selectExpr("id", "CAST(id AS STRING) AS v", "id * 1.5 AS n")
    rows.write.format("delta").option("delta.enableDeletionVectors", "true").save(path)
    changes = spark.range(100, 300).selectExpr("id", "CAST(id AS STRING) AS v", "id / 3.0 AS n")
    target = DeltaTable.forPath(spark, path)
    merge = target.alias("t").merge(changes.alias("s"), "t.id = s.id")
    merge.whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()
    target.delete("id % 11 = 0")
    spark.sql(f"OPTIMIZE delta.`{path}`").collect()
    spark.read.format("delta").load(path).groupBy("v").count().collect()


#: Spark did not start (Java, or the first download of the jars): the job that follows will say why; the shell
#: tries again at the next start instead of giving up on the archive.
NOT_STARTED = 3


def main(argv: list[str]) -> int:
    """Run the workload and stop; the shell waits for the JVM, which writes the archive as it exits.

    With ``--ready`` (``./replica setup``, through ``spark-submit.sh``, which makes the archive before it runs a job)
    start nothing and say whether the archive is there, so that no later job start pays the minute.
    """
    if argv == ["--ready"]:
        return _report(local_settings().class_archive_dir)
    try:
        spark = build_session("replica-class-archive", local_settings())
    except SetupError:
        return NOT_STARTED
    gateway = spark.sparkContext._gateway
    with tempfile.TemporaryDirectory(prefix="replica-class-archive-") as work:
        _load_classes(spark, Path(work))
    spark.stop()
    # The JVM exits when its stdin closes (pyspark's gateway) and writes the archive on the way out: wait for it,
    # so that the archive is whole when the shell moves it into place.
    process = getattr(gateway, "proc", None)
    if process is not None:
        process.stdin.close()
        return 0 if process.wait(timeout=300) == 0 else 1
    return 0


def _report(folder: Path) -> int:
    archives = sorted(folder.glob("spark-*.jsa"))
    if archives:
        print(f"class archive: {archives[-1]} ({archives[-1].stat().st_size >> 20} MB)")
    else:  # off (REPLICA_CLASS_ARCHIVE=off), or a failed attempt, which spark-submit.sh has reported
        print("class archive: none (jobs start without one)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
