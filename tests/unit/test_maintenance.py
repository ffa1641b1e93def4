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
