"""Where a run's CPU went: a real flight recording of a Spark job, its samples summed by kind of work."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from replica_dev.cpuprofile import OTHER, Recorder, kind_of, read, table


def test_a_sample_is_of_the_innermost_kind_unless_code_generation_encloses_it() -> None:
    jackson = ["java.lang.String.charAt", "com.fasterxml.jackson.core.json.ReaderBasedJsonParser.nextToken"]
    assert kind_of([*jackson, "org.apache.spark.sql.catalyst.json.JacksonParser.parse"]) == "JSON parsing"
    formatting = [
        "java.util.regex.Matcher.replaceAll",
        "org.apache.spark.sql.catalyst.expressions.codegen.CodeFormatter$.stripExtraNewLinesAndComments",
        "org.apache.spark.sql.delta.stats.DeltaTaskStatisticsTracker.<init>",
    ]
    assert kind_of(formatting) == "code generation"
    assert kind_of(["java.util.regex.Matcher.find", "org.apache.spark.sql.catalyst.expressions.RLike.eval"]) == (
        "regular expressions"
    )
    assert kind_of(["java.lang.Thread.run"]) == OTHER


def test_a_recording_of_a_json_parse_says_the_tasks_parsed_json(spark: SparkSession, tmp_path: Path) -> None:
    rows = spark.range(600_000).select(F.to_json(F.struct((F.col("id") * 7).alias("a"), F.lit("x").alias("b"))))
    rows = rows.cache()  # written before the recording, so that it holds the parse alone
    rows.count()
    parsed = rows.select(F.from_json(rows.columns[0], "a LONG, b STRING").alias("p"))
    path = tmp_path / "parse.jfr"
    with Recorder(spark, path) as recording:
        assert parsed.agg(F.sum("p.a")).first() == (7 * 599_999 * 600_000 // 2,)
    profile = read(path, recording.java_home)
    rows.unpersist()

    assert profile.tasks.most_common(1)[0][0] == "JSON parsing"
    lines = list(table({"parse": profile.as_dict()}, {"parse": 600_000}))
    assert lines[0].startswith("task threads, CPU ms per 1,000 changes")
    assert any(line.split()[:2] == ["JSON", "parsing"] for line in lines)
