"""A tiny run of the benchmark job, as users run it: every contender, every phase, every table checked, every run
profiled.

Freshness runs for the ceiling and both layouts only: the others start as in the catch-up, and each run costs
seconds of a cold JVM's warm-up (the command runs every contender in every phase).

The run is started with the suite's integration tests (after the catalog server's start), at the lowest CPU priority,
and this test (collected last) waits for it and checks what it wrote: the job is a process of its own, whose three
minutes on both cores fit in what the suite's own tests leave idle (about a fifth of the two cores). It asserts no
figure, only that every part ran and every table equals the model.
"""

from __future__ import annotations

import json
import os

import pytest

from replica_lib.catalog import pending_dir
from replica_lib.config import local_settings
from tests.integration.support import BenchStarter

pytestmark = pytest.mark.integration


def test_bench_job_runs_every_contender_and_every_phase(bench_run: BenchStarter | None) -> None:
    assert bench_run is not None  # for this test (tests/integration/conftest.py)
    run = bench_run.start()  # started beside the tests before, unless this one runs alone
    returncode, stdout, stderr = run.wait()
    out = run.out
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    # Its replicas are throwaway: none of them is left for the user's catalog to register.
    own = local_settings({**os.environ, "REPLICA_CATALOG_DIR": str(run.catalog)})
    assert list(pending_dir(own).glob("*")) == []
    assert "contender" in stdout and "ours_vs_ceiling" in stdout

    (report_path,) = out.glob("bench-*.json")
    report = json.loads(report_path.read_text())
    assert set(report["floor"]) == {"spark_job_s", "delta_append_20_rows_s", "delta_merge_20_rows_s"}
    assert all(seconds > 0 for seconds in report["floor"].values())
    assert "fixed cost on this machine" in stdout
    catch_up = report["catch_up"]
    assert set(catch_up) == {"ceiling", "naive", "peer", "ours", "ours-mor", "ceiling_bulk", "rebuild", "naive_bulk"}
    for name, run in catch_up.items():
        assert run["records"] == 400, name
        assert run["events_per_s"] > 0 and run["batch_p50_s"] > 0, name
        if name.startswith("ceiling"):
            assert run["check"] is None
        else:  # every maintained table equals the workload folded per key
            assert run["check"]["missing"] == run["check"]["extra"] == run["check"]["different"] == 0, name
            assert run["check"]["rows"] > 0
        # Each run's flight recording, summed by kind of work: the JVM was sampled while it ran.
        assert sum(run["profile"]["tasks"].values()) + sum(run["profile"]["driver"].values()) > 0, name
    assert "where the CPU went" in stdout
    assert catch_up["ours"]["batches"] >= 3 and catch_up["rebuild"]["batches"] == 1  # batches of 150 at most
    assert catch_up["naive_bulk"]["batches"] == 1
    assert catch_up["ours-mor"]["batches"] >= 3

    readers = report["readers"]
    assert set(readers) == {"ours", "ours-mor"}
    rows = catch_up["ours"]["check"]["rows"]
    for costs in (readers["ours"], readers["ours-mor"]["pending"], readers["ours-mor"]["folded"]):
        assert costs["rows"] == rows and costs["aggregate_s"] > 0 and costs["point_s"] > 0
    assert readers["ours-mor"]["pending_changes"] > 0 and readers["ours-mor"]["fold_s"] > 0
    assert "readers (median of 1): ours aggregate" in stdout

    assert set(report["freshness"]) == {"ceiling", "ours", "ours-mor"}
    for name, fresh in report["freshness"].items():
        assert fresh["events"] == 100, name
        assert 0 < fresh["fresh_p50_s"] <= fresh["fresh_p99_s"] <= fresh["fresh_max_s"], name
    assert set(report["growth"]) == set(report["growth_mor"]) == {"uniform"}
    assert report["growth"]["uniform"]["1000"]["batches"] and report["growth"]["uniform"]["1000"]["batch_p50_s"] > 0
    mor = report["growth_mor"]["uniform"]["1000"]  # merge-on-read: its batches, then one fold of their changes
    assert mor["batches"] and mor["batch_p50_s"] > 0 and mor["fold_s"] > 0 and mor["folded_keys"] > 0
    assert set(report["ratios"]) >= {
        "ours_vs_ceiling",
        "ours_vs_naive",
        "ours_vs_peer",
        "ours_mor_vs_ceiling",
        "best_vs_ceiling",
        "rebuild_vs_ceiling",
        "rebuild_vs_naive_bulk",
        "ours_fresh_p99_vs_ceiling",
        "ours_mor_fresh_p99_vs_ceiling",
        "growth_uniform_largest_vs_smallest",
        "growth_mor_uniform_largest_vs_smallest",
        "growth_mor_uniform_fold_largest_vs_smallest",
    }
    (plot,) = out.glob("bench-*.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
