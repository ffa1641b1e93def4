"""Maintenance of a replica's files (OPTIMIZE, VACUUM) beside the running replica, on a real broker, Spark and Delta."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from jobs.maintain import main as maintain_main
from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_dev.model import LoggedChange
from replica_lib import batch
from replica_lib.config import Target, load_replica
from replica_lib.errors import ConcurrentDeleteReadError
from replica_lib.merge import compact_files, vacuum_files
from replica_lib.recovery import release_checkpoint
from replica_lib.stream import start_replica
from replica_lib.target import LogState, delta_table, file_count, latest_version, log_state, replica_targets, table_id
from tests.integration.support import delete, produce, replica_config, run_available_now, upsert
from tests.integration.test_semantics import assert_matches_model

pytestmark = pytest.mark.integration


def test_a_merge_that_loses_to_a_concurrent_optimize_runs_again_on_the_new_version(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = topic_factory(partitions=2)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "retry", {"orders": orders_table(topic)})
    log = produce(connection, topic, [upsert(k, 1, "new") for k in range(10)])
    run_available_now(spark, cfg)
    log += produce(connection, topic, [upsert(k, 2, "paid") for k in range(5)] + [delete(5, 2)])

    # An operator's OPTIMIZE commits while the batch's MERGE runs: Delta refuses the MERGE's commit (it read files
    # the OPTIMIZE removed). The OPTIMIZE here is real; Delta's refusal is raised as Delta raises it.
    real_merge, calls = batch.merge_rows, []

    def losing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            compact_files(spark, cfg.table("orders").target, 1 << 30)
            raise ConcurrentDeleteReadError("[DELTA_CONCURRENT_DELETE_READ] This transaction attempted to read")
        return real_merge(*args, **kwargs)

    monkeypatch.setattr(batch, "merge_rows", losing_once)
    with caplog.at_level(logging.WARNING, logger="replica_lib.batch"):
        run_available_now(spark, cfg)
    assert len(calls) == 2
    assert any("merging again on its new version (attempt 2 of 5)" in r.getMessage() for r in caplog.records)
    assert_matches_model(spark, cfg, log)


def _data_files(path: str) -> int:
    return sum(1 for f in Path(path).glob("*.parquet"))  # the log's own checkpoints are in _delta_log


def test_optimize_and_vacuum_beside_the_running_replica_keep_it_exact_and_reduce_its_files(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = topic_factory(partitions=2)
    conf = tmp_path / "beside.toml"
    doc = replica_doc(
        "beside",
        tmp_path / "beside",
        connection["bootstrap.servers"],
        {"orders": orders_table(topic)},
        source={"starting_offsets": "earliest", "max_offsets_per_trigger": 40},
        trigger={"interval": "0 seconds"},
        compaction={"every_batches": 0},  # the replica packs nothing itself: its small files pile up
    )
    write_replica(conf, doc)
    cfg = load_replica(conf)
    target = cfg.table("orders").target
    log: list[LoggedChange] = []
    # Seq 2 deletes the odd keys (the rewrite keeps the even ones in a file), seq 3 inserts them again (new files
    # beside it: several files to pack), seq 4 updates every key after the OPTIMIZE.
    rounds = {1: range(40), 2: range(1, 40, 2), 3: range(1, 40, 2), 4: range(40)}
    query = start_replica(spark, cfg)
    try:
        for seq, keys in rounds.items():
            log += produce(connection, topic, [delete(k, seq) if seq == 2 else upsert(k, seq, f"s{seq}") for k in keys])
            query.processAllAvailable()
            if seq == 2:  # a retention the running replica might need is refused before anything is done
                files = file_count(spark, target)
                assert maintain_main([str(conf), "--retain-hours", "0"]) == 2
                assert "a retention of 0 h is shorter than the table's time-travel window" in capsys.readouterr().err
                assert file_count(spark, target) == files
            if seq == 3:  # OPTIMIZE (z-ordered by key) and VACUUM (the time-travel window) while the replica runs
                files = file_count(spark, target)
                assert files > 1
                assert maintain_main([str(conf), "--zorder"]) == 0
                out = capsys.readouterr().out
                packed = f"{files} files, 1 after z-ordered by order_id; vacuum (keeping 168 h)"
                assert f"beside: {target.describe()}: {packed}" in out
        query.processAllAvailable()
        assert query.exception() is None
    finally:
        query.stop()
    assert_matches_model(spark, cfg, log)

    # With the replica stopped and every table's time-travel window shortened to nothing, VACUUM deletes every file
    # no current version references; the state is unchanged.
    release_checkpoint(cfg)
    window = "'delta.deletedFileRetentionDuration' = 'interval 0 hours'"
    for each in replica_targets(cfg):
        spark.sql(f"ALTER TABLE {each.describe()} SET TBLPROPERTIES ({window})")
    on_disk = _data_files(str(target.path))
    assert maintain_main([str(conf), "--retain-hours", "0"]) == 0
    assert "1 after optimize; vacuum (keeping 0 h):" in capsys.readouterr().out
    assert _data_files(str(target.path)) == file_count(spark, target) < on_disk
    assert_matches_model(spark, cfg, log)


def test_the_logs_state_is_what_delta_says_of_the_table_and_none_where_there_is_no_table(
    spark: SparkSession, tmp_path: Path
) -> None:
    missing = Target(path=str(tmp_path / "missing"))
    plain = tmp_path / "plain"
    spark.range(3).write.parquet(str(plain))  # a folder of Parquet files, not a Delta table
    assert log_state(spark, missing) is None
    assert log_state(spark, Target(path=str(plain))) is None
    assert latest_version(spark, missing) is None and table_id(spark, missing) is None

    table = Target(path=str(tmp_path / "table"))
    spark.range(5).repartition(2).write.format("delta").save(table.path)
    spark.range(5, 8).coalesce(1).write.format("delta").mode("append").save(table.path)
    state = log_state(spark, table)
    detail = delta_table(spark, table).detail().select("numFiles", "sizeInBytes").first()
    assert detail is not None
    assert state == LogState(version=1, files=int(detail[0]), size_bytes=int(detail[1]))
    assert state.files == 3 and latest_version(spark, table) == 1
    assert table_id(spark, table) == str(delta_table(spark, table).detail().first()["id"])


def test_vacuum_keeps_the_hours_it_is_given_not_only_the_tables_window(spark: SparkSession, tmp_path: Path) -> None:
    """A retention longer than the table's time-travel window keeps the files that no version in the window
    references (Delta 4.4 uses the table's window unless told to take the one given)."""
    path = tmp_path / "t"
    spark.range(10).coalesce(1).write.format("delta").save(str(path))
    first = set(path.glob("*.parquet"))
    window = "'delta.deletedFileRetentionDuration' = 'interval 0 hours'"
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({window})")
    spark.range(5).write.format("delta").mode("overwrite").save(str(path))  # the first files are now unreferenced
    assert vacuum_files(spark, Target(path=str(path)), 100.0) == 0
    assert first and all(f.exists() for f in first)
    assert vacuum_files(spark, Target(path=str(path)), 0.0) == len(first)
    assert not any(f.exists() for f in first)
