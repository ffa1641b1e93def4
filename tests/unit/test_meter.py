"""replica_lib.meter: a long Spark job's progress in records, from its finished tasks."""

from __future__ import annotations

import io

from pyspark.sql import SparkSession

from replica_lib.meter import Reading, line, metered


def test_the_line_counts_records_by_finished_tasks_of_the_read() -> None:
    assert line("rebuild a", 1_000_000, None, 0.0) == "rebuild a: starting, 1,000,000 records to read"
    assert line("rebuild a", 1_000_000, Reading(1, 4), 10.0) == (
        "rebuild a: read 250,000 of 1,000,000 records (25%), 25,000/s, 30 s left"
    )
    assert line("rebuild a", 1_000_000, Reading(4, 4, "save: 1/3 tasks"), 40.0) == (
        "rebuild a: read 1,000,000 records; save: 1/3 tasks"
    )


def test_the_meter_sees_the_jobs_of_its_block(spark: SparkSession) -> None:
    out = io.StringIO()
    with metered(spark, "t", 1_000, out) as meter:
        spark.range(0, 1_000, 1, 5).selectExpr("sum(id)").collect()
        reading = meter.reading()
    assert reading == Reading(5, 5)
    spark.range(0, 10, 1, 3).collect()  # after the block, jobs are no longer in its group
    assert meter.reading() == Reading(5, 5)
    assert out.getvalue() == ""  # not a terminal: its lines go to the log
