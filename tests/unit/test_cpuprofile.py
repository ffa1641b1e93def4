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
    # Sixteen fields a row, so that the parse outweighs reading each row from the cache: with two, the cache's rows
    # and expressions took 40-53% of the samples and twice outranked the parse.
    fields = [(F.col("id") * k).alias(f"a{k}") for k in range(1, 9)] + [
        F.lit("a few words").alias(f"s{k}") for k in range(8)
    ]
    rows = spark.range(400_000).select(F.to_json(F.struct(*fields)))
    rows = rows.cache()  # written before the recording, so that it holds the parse alone
    rows.count()
    schema = ", ".join([f"a{k} LONG" for k in range(1, 9)] + [f"s{k} STRING" for k in range(8)])
    parsed = rows.select(F.from_json(rows.columns[0], schema).alias("p"))
    path = tmp_path / "parse.jfr"
    with Recorder(spark, path) as recording:
        assert parsed.agg(F.sum("p.a7"), F.max("p.s7")).first() == (7 * 399_999 * 400_000 // 2, "a few words")
    profile = read(path, recording.java_home)
    rows.unpersist()

    assert profile.tasks.most_common(1)[0][0] == "JSON parsing", profile.tasks.most_common(5)  # the counts, if not
    lines = list(table({"parse": profile.as_dict()}, {"parse": 400_000}))
    assert lines[0].startswith("task threads, CPU ms per 1,000 changes")
    assert any(line.split()[:2] == ["JSON", "parsing"] for line in lines)
