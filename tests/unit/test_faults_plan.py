"""The fault harness's plan and crash points, without a replica: what a plan accepts and what a window does."""

from __future__ import annotations

import pytest

from replica_dev.chaos import ChaosPlan
from replica_dev.faults import CrashPoint, InjectedCrash
from replica_lib.config import COPY_ON_WRITE, MERGE_ON_READ


def test_killed_windows_must_be_windows_the_plan_crashes() -> None:
    plan = ChaosPlan(layouts=(COPY_ON_WRITE, MERGE_ON_READ), killed_windows=("after_tombstones", "after_fold_merge"))
    assert set(plan.killed_windows or ()) < set(plan.windows)
    with pytest.raises(ValueError, match="killed windows"):
        ChaosPlan(layouts=(COPY_ON_WRITE,), killed_windows=("after_fold_merge",))  # no fold in a copy-on-write plan


def test_an_in_process_crash_point_raises_once_at_its_point_and_batch() -> None:
    crash = CrashPoint("after_commit", batch_id=3, in_process=True)
    at = crash.hooks().at
    assert at is not None
    at("after_quarantine", 3)  # another point of the batch
    at("after_commit", 2)  # the point, of another batch
    assert not crash.hit.is_set()
    with pytest.raises(InjectedCrash, match="batch 3: crashed at after_commit"):
        at("after_commit", 3)
    assert crash.hit.is_set()
    at("after_commit", 3)  # the batch run again after the crash goes through
