"""Reading Spark's event logs: a rolling log's folder in order, and a clear refusal of what is not plain text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replica_dev.eventlog import EventLogError, _events, read_batches, summary


def write_events(path: Path, *numbers: int) -> None:
    path.write_text("".join(json.dumps({"Event": "Test", "n": n}) + "\n" for n in numbers), encoding="utf-8")


def test_a_rolling_logs_folder_reads_its_event_files_in_order_and_nothing_else(tmp_path: Path) -> None:
    write_events(tmp_path / "events_10_local-1", 3)
    write_events(tmp_path / "events_2_local-1", 2)
    write_events(tmp_path / "events_1_local-1", 0, 1)
    (tmp_path / "appstatus_local-1").write_text("", encoding="utf-8")
    (tmp_path / ".events_1_local-1.crc").write_bytes(b"crc\x00\xff")

    assert [event["n"] for event in _events(tmp_path)] == [0, 1, 2, 3]


def test_a_compressed_or_binary_log_is_refused_with_the_setting_that_writes_a_plain_one(tmp_path: Path) -> None:
    compressed = tmp_path / "events_1_local-1.zstd"
    compressed.write_bytes(b"(\xb5/\xfd")
    with pytest.raises(EventLogError, match=r"events_1_local-1.zstd is compressed \(zstd\).*compress=false"):
        list(_events(tmp_path))
    binary = tmp_path / "local-2"
    binary.write_bytes(b"(\xb5/\xfd\x00\xff")
    with pytest.raises(EventLogError, match=r"local-2:1: not a plain-text Spark event log.*compress=false"):
        list(_events(binary))


def test_a_batch_holds_its_jobs_its_addbatch_and_its_whole_trigger(tmp_path: Path) -> None:
    props = {"sql.streaming.queryId": "q1", "streaming.sql.batchId": "0", "spark.job.description": "decode"}
    events = [
        {"Event": "SparkListenerJobStart", "Job ID": 1, "Submission Time": 1_000, "Stage IDs": [], "Properties": props},
        {"Event": "SparkListenerJobEnd", "Job ID": 1, "Completion Time": 1_300},
        {
            "Event": "org.apache.spark.sql.streaming.StreamingQueryListener$QueryProgressEvent",
            "progress": {
                "id": "q1",
                "batchId": 0,
                "name": "r",
                "durationMs": {"addBatch": 500, "triggerExecution": 700},
            },
        },
    ]
    log = tmp_path / "app"
    log.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    (row,) = summary(read_batches(log))
    assert (row["query"], row["jobs"], row["trigger_ms"], row["add_batch_ms"], row["job_ms"], row["driver_ms"]) == (
        "r",
        1,
        700,
        500,
        300,
        200,
    )
