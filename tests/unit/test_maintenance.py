"""Maintenance retries a delete that the running replica's append conflicted with, and only that."""

from __future__ import annotations

import pytest

from replica_lib import maintenance
from replica_lib.errors import MaintenanceError

CONFLICT = "io.delta.exceptions.ConcurrentAppendException: [DELTA_CONCURRENT_APPEND] Files were added"


def test_a_conflicting_delete_runs_again_until_it_commits() -> None:
    calls = []

    def delete() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError(CONFLICT)
        return 7

    assert maintenance._retrying("compacting t", delete) == 7
    assert len(calls) == 3


def test_a_delete_that_always_conflicts_stops_with_what_to_do() -> None:
    def delete() -> int:
        raise RuntimeError(CONFLICT)

    with pytest.raises(
        MaintenanceError, match=f"during each of {maintenance.ATTEMPTS} attempts; run maintenance again"
    ):
        maintenance._retrying("compacting t", delete)


def test_any_other_error_is_raised_at_once() -> None:
    calls = []

    def delete() -> int:
        calls.append(1)
        raise ValueError("no such table")

    with pytest.raises(ValueError, match="no such table"):
        maintenance._retrying("compacting t", delete)
    assert len(calls) == 1
