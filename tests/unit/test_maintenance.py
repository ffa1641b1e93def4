"""Maintenance retries a delete that the running replica's append or compaction conflicted with, and only that."""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession

from replica_lib import maintenance
from replica_lib.errors import (
    ConcurrentAppendError,
    ConcurrentCommitError,
    ConcurrentDeleteDeleteError,
    ConcurrentDeleteReadError,
    MaintenanceError,
)
from tests.unit.test_compaction import thrower

APPENDED = ConcurrentAppendError("[DELTA_CONCURRENT_APPEND] Files were added")
COMPACTED = ConcurrentDeleteReadError("[DELTA_CONCURRENT_DELETE_READ] This transaction attempted to read")
DELETED = ConcurrentDeleteDeleteError("[DELTA_CONCURRENT_DELETE_DELETE] This transaction attempted to delete")


@pytest.mark.parametrize("conflicts", [[APPENDED, APPENDED], [COMPACTED], [APPENDED, COMPACTED, DELETED]])
def test_a_conflicting_delete_runs_again_until_it_commits(conflicts: list[ConcurrentCommitError]) -> None:
    calls = []

    def delete() -> int:
        calls.append(1)
        if len(calls) <= len(conflicts):
            raise conflicts[len(calls) - 1]
        return 7

    assert maintenance._retrying("compacting t", delete) == 7
    assert len(calls) == len(conflicts) + 1


def test_delta_s_own_conflict_is_retried(spark: SparkSession) -> None:
    """Delta's JVM exception, thrown through py4j, is recognised by its class."""
    calls = []
    append = thrower(spark, "io.delta.exceptions.ConcurrentAppendException", "[DELTA_CONCURRENT_APPEND] Files")

    def delete() -> int:
        calls.append(1)
        if len(calls) == 1:
            append()
        return 7

    assert maintenance._retrying("compacting t", delete) == 7
    assert len(calls) == 2


def test_a_delete_that_always_conflicts_stops_with_what_to_do() -> None:
    def delete() -> int:
        raise APPENDED

    with pytest.raises(
        MaintenanceError, match=f"during each of {maintenance.ATTEMPTS} attempts; run maintenance again"
    ):
        maintenance._retrying("compacting t", delete)


@pytest.mark.parametrize(
    "error", [ValueError("no such table"), ConcurrentCommitError("[DELTA_CONCURRENT_TRANSACTION] same app id")]
)
def test_any_other_error_is_raised_at_once(error: Exception) -> None:
    calls = []

    def delete() -> int:
        calls.append(1)
        raise error

    with pytest.raises(type(error)) as raised:
        maintenance._retrying("compacting t", delete)
    assert raised.value is error
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("interval", "hours"),
    [
        ("interval 1 week", 168.0),
        ("interval 2 days 12 hours", 60.0),
        ("INTERVAL 90 MINUTES", 1.5),
        ("interval 0 hours", 0.0),
    ],
)
def test_delta_intervals_read_as_hours(interval: str, hours: float) -> None:
    assert maintenance.interval_hours(interval) == hours


def test_a_value_that_is_no_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="is not a Delta interval"):
        maintenance.interval_hours("7 days")


def test_vacuum_keeps_the_time_travel_window_by_default_and_at_least_an_hour_while_the_replica_runs() -> None:
    assert maintenance.vacuum_retention("t", None, 168.0, running=True) == 168.0
    assert maintenance.vacuum_retention("t", None, 0.0, running=True) == 1.0
    assert maintenance.vacuum_retention("t", None, 0.0, running=None) == 1.0  # cannot tell: as if running
    assert maintenance.vacuum_retention("t", 0.0, 0.0, running=False) == 0.0
    assert maintenance.vacuum_retention("t", 200.0, 168.0, running=True) == 200.0


def test_a_retention_shorter_than_the_time_travel_window_is_refused_with_the_fix() -> None:
    with pytest.raises(MaintenanceError) as refused:
        maintenance.vacuum_retention("delta.`/t`", 24.0, 168.0, running=False)
    assert str(refused.value).startswith("delta.`/t`: a retention of 24 h is shorter than the table's time-travel")
    assert "give --retain-hours 168 or more" in str(refused.value)
    assert "SET TBLPROPERTIES ('delta.deletedFileRetentionDuration'" in str(refused.value)
    with pytest.raises(MaintenanceError):  # NaN passes every comparison, and VACUUM would take it as 0 h
        maintenance.vacuum_retention("delta.`/t`", float("nan"), 168.0, running=False)


@pytest.mark.parametrize(("running", "state"), [(True, "is running"), (None, "may be running")])
def test_a_retention_under_an_hour_is_refused_while_the_replica_may_run(running: bool | None, state: str) -> None:
    refused = f"refused while the replica {state}.*: .* give --retain-hours 1 or more"
    with pytest.raises(MaintenanceError, match=refused):
        maintenance.vacuum_retention("t", 0.0, 0.0, running=running)
