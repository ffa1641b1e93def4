"""Exactly-once under faults: the CI variant of the fault harness (the long one is ./replica chaos)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from replica_dev.chaos import ChaosPlan, run_broker_outages, run_chaos
from replica_dev.embedded_kafka import EmbeddedKafka
from replica_lib.batch import FOLD_COMPACTION_POINT, HOOK_POINTS
from replica_lib.config import COPY_ON_WRITE, MERGE_ON_READ, LocalSettings
from replica_lib.layout import FOLD_POINTS

pytestmark = pytest.mark.integration


def test_random_kills_and_every_crash_window_leave_every_version_of_both_layouts_exact(
    spark: SparkSession, kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    # The suite's short variant (`./replica chaos --kills 30` soaks, every window by a SIGKILL): one replica with a
    # copy-on-write and a merge-on-read table, so that each launch (about a minute) serves both. Each window of a
    # batch and of a fold is crashed once: one window of each layout by a SIGKILL of the launched job, the others by
    # a raise at the window in this process (the same files on disk, without a launch each); then a random kill,
    # then a second instance started by mistake beside the last run. Every MERGE writes deletion vectors, so the
    # files pile up and the replica's compaction runs between crashes; the MERGEs that rewrite their files (the
    # choice for a table this small) are crashed in-process by test_layouts.py. The primary writes 2 changes a
    # second (the soak's 20): enough for every run to find records, few enough that the last run drains what the
    # others left in a few batches and the oracle has few versions to travel to.
    plan = ChaosPlan(
        keys=150,
        kills=1,
        rate=2.0,
        seed=4,
        deletion_vectors=True,
        layouts=(COPY_ON_WRITE, MERGE_ON_READ),
        killed_windows=("after_tombstones", "after_fold_merge"),
        second_instance=True,
    )
    report = run_chaos(spark, plan, tmp_path, kafka.bootstrap_servers)
    print("\n".join(report.lines()))
    assert plan.windows == (*HOOK_POINTS, *FOLD_POINTS, FOLD_COMPACTION_POINT)
    assert report.kills == 1 and report.second_instance_refused
    assert report.crashes == dict.fromkeys(plan.windows, 1)
    assert report.crashed_in_process == [w for w in plan.windows if w not in (plan.killed_windows or ())]
    assert report.events > 0 and report.versions_checked > 0 and report.compactions > 0
    assert (report.lost, report.extra, report.duplicates, report.stale) == (0, 0, 0, 0)
    assert (report.versions_wrong, report.batches_committed_twice, report.offsets_backwards) == (0, 0, 0)


def test_broker_killed_under_a_running_replica_and_down_at_start_loses_and_doubles_nothing(
    spark: SparkSession, settings: LocalSettings, tmp_path: Path
) -> None:
    # The suite's short variant: one outage under the running replica (./replica chaos --broker-outages N soaks),
    # the primary writing 2 changes a second (the soak's 20).
    with EmbeddedKafka(tmp_path / "broker", settings.state_dir, settings.java_home) as broker:
        report = run_broker_outages(
            spark,
            ChaosPlan(keys=100, rate=2.0, seed=9, deletion_vectors=True, compact_every_batches=1),
            tmp_path / "run",
            broker,
            outages=1,
        )
    print("\n".join(report.lines()))
    assert (report.broker_kills, report.kills) == (2, 0)  # one outage under a running replica, one before a start
    assert report.events > 0 and report.versions_checked > 0 and report.compactions > 0
    assert report.ok, report.lines()
