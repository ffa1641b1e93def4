"""Exactly-once under faults: the CI variant of the fault harness (the long one is ./replica chaos)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from replica_dev.chaos import ChaosPlan, run_broker_outages, run_chaos, run_second_instance
from replica_dev.embedded_kafka import EmbeddedKafka
from replica_dev.faults import WINDOWS
from replica_lib.config import COPY_ON_WRITE, MERGE_ON_READ, LocalSettings

pytestmark = pytest.mark.integration


#: Merge-on-read's windows in the suite: its batch's own write (the change log's append) and the fold's MERGE. Its
#: other windows are the batch's, run here with copy-on-write; each of the fold's points is also crashed in-process
#: by tests/integration/test_layouts.py. `./replica chaos --layout merge-on-read` runs them all.
MOR_WINDOWS = ("after_commit", "after_fold_merge")


@pytest.mark.parametrize(
    ("layout", "windows", "kills", "seed", "deletion_vectors"),
    [(COPY_ON_WRITE, WINDOWS[COPY_ON_WRITE], 1, 4, True), (MERGE_ON_READ, MOR_WINDOWS, 0, 6, None)],
)
def test_random_kills_and_every_crash_window_leave_every_version_exact(
    spark: SparkSession,
    kafka: EmbeddedKafka,
    tmp_path: Path,
    layout: str,
    windows: tuple[str, ...],
    kills: int,
    seed: int,
    deletion_vectors: bool | None,
) -> None:
    # The suite's short variant: each crash window once and a random kill (`./replica chaos --kills 30` soaks); a
    # launch costs about a minute. Copy-on-write: every MERGE writes deletion vectors, so the files pile up and the
    # replica's compaction runs between kills; the MERGEs that rewrite their files (the choice for a table this
    # small) are killed in the merge-on-read run, whose table is folded every 2nd batch.
    plan = ChaosPlan(
        keys=150, kills=kills, crash_windows=windows, seed=seed, deletion_vectors=deletion_vectors, layout=layout
    )
    report = run_chaos(spark, plan, tmp_path, kafka.bootstrap_servers)
    print("\n".join(report.lines()))
    assert report.kills == kills
    assert report.crashes == dict.fromkeys(windows, 1)
    assert report.events > 0 and report.versions_checked > 0
    if deletion_vectors:
        assert report.compactions > 0
    assert (report.lost, report.extra, report.duplicates, report.stale) == (0, 0, 0, 0)
    assert (report.versions_wrong, report.batches_committed_twice, report.offsets_backwards) == (0, 0, 0)


def test_broker_killed_twice_and_down_at_start_loses_and_doubles_nothing(
    spark: SparkSession, settings: LocalSettings, tmp_path: Path
) -> None:
    with EmbeddedKafka(tmp_path / "broker", settings.state_dir, settings.java_home) as broker:
        report = run_broker_outages(
            spark, ChaosPlan(keys=100, seed=9, deletion_vectors=True), tmp_path / "run", broker, outages=2
        )
    print("\n".join(report.lines()))
    assert report.kills == 3  # two outages under a running replica, one before a start
    assert report.events > 0 and report.versions_checked > 0 and report.compactions > 0
    assert report.ok, report.lines()


def test_a_second_instance_of_a_running_replica_fails_clearly(
    spark: SparkSession, kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    report = run_second_instance(spark, ChaosPlan(keys=100, seed=11), tmp_path, kafka.bootstrap_servers)
    print("\n".join(report.lines()))
    assert report.events > 0
    assert report.ok, report.lines()
