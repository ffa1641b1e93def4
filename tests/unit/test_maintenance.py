"""Maintenance retries a delete that the running replica's append or compaction conflicted with, and only that."""

from __future__ import annotations

import pytest

from replica_lib import maintenance
from replica_lib.errors import MaintenanceError

CONFLICT = "io.delta.exceptions.ConcurrentAppendException: [DELTA_CONCURRENT_APPEND] Files were added"
COMPACTED = "io.delta.exceptions.ConcurrentDeleteReadException: [DELTA_CONCURRENT_DELETE_READ] This transaction"


@pytest.mark.parametrize("conflicts", [[CONFLICT, CONFLICT], [COMPACTED], [CONFLICT, COMPACTED]])
def test_a_conflicting_delete_runs_again_until_it_commits(conflicts: list[str]) -> None:
    calls = []

    def delete() -> int:
        calls.append(1)
        if len(calls) <= len(conflicts):
            raise RuntimeError(conflicts[len(calls) - 1])
        return 7

    assert maintenance._retrying("compacting t", delete) == 7
    assert len(calls) == len(conflicts) + 1


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
