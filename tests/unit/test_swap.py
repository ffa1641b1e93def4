"""The swap's pure parts: its plan, the later of two positions, and waiting for a running replica to stop."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_lib.config import load_replica
from replica_lib.errors import CheckpointError
from replica_lib.recovery import LOCK_FILE, release_checkpoint, wait_until_stopped
from replica_lib.swap import SwapPlan, _later


def test_a_swap_plan_reads_back_as_written() -> None:
    plan = SwapPlan("0123456789ab", {"orders": {0: 5, 2: 9}}, {"orders": {0: 7, 1: 3, 2: 9}}, resolved_version=4)
    assert SwapPlan.parse(plan.to_json()) == plan
    assert SwapPlan.parse(replace(plan, resolved_version=-1).to_json()).resolved_version == -1  # none yet
    # A plan from before the version was recorded reads the live quarantine's resolutions as they are.
    assert SwapPlan.parse(replace(plan, resolved_version=None).to_json()).resolved_version is None


def test_the_later_position_takes_each_partition_from_whichever_is_further() -> None:
    rebuilt = {"orders": {0: 10, 1: 4}}
    live = {"orders": {0: 8, 1: 6, 2: 1}, "refunds": {0: 3}}
    assert _later(rebuilt, live) == {"orders": {0: 10, 1: 6, 2: 1}, "refunds": {0: 3}}
    assert _later(rebuilt, None) == rebuilt


def test_a_swap_waits_for_the_replica_holding_the_checkpoint_and_gives_up_after_its_time(tmp_path: Path) -> None:
    conf = tmp_path / "live.toml"
    write_replica(conf, replica_doc("live", tmp_path / "live", "127.0.0.1:9", {"orders": orders_table("orders")}))
    cfg = load_replica(conf)
    folder = Path(cfg.checkpoint)
    folder.mkdir(parents=True)
    # Another process holds the lock as a running replica does, until its stdin closes.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
            "sys.stdin.read()",
            str(folder / LOCK_FILE),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    told: list[bool] = []
    with pytest.raises(CheckpointError, match=r"already running on checkpoint .* \(waited 1 s\)"):
        wait_until_stopped(cfg, 1.0, lambda: told.append(True))
    assert told == [True]
    assert holder.stdin is not None
    holder.stdin.close()  # the replica stops: the kernel drops its lock
    assert holder.wait(timeout=30) == 0
    wait_until_stopped(cfg, 30.0, lambda: told.append(True))
    assert told == [True]  # taken at once, nobody told to wait
    release_checkpoint(cfg)
