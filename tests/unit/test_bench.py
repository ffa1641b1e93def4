"""The benchmark's pure parts: its arguments, its workload and its figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replica_dev.bench import (
    CONTENDERS,
    BenchPlan,
    Event,
    freshness_lags,
    median_round,
    percentile,
    ratios,
    round_ratios,
    summary_lines,
    workload,
)
from replica_lib.errors import ConfigError


def test_bad_arguments_name_the_flag_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"--batch-size.*at least 1"):
        BenchPlan(batch_size=0)
    with pytest.raises(ConfigError, match=r"--contenders.*unknown \['fastest'\]"):
        BenchPlan(contenders=("ours", "fastest"))
    with pytest.raises(ConfigError, match="--delete-share"):
        BenchPlan(delete_share=1.5)
    with pytest.raises(ConfigError, match="--fold-every-batches"):
        BenchPlan(fold_every_batches=-1)
    with pytest.raises(ConfigError, match=r"--growth-keys.*unknown \['zipf'\].*uniform,recent"):
        BenchPlan(growth_keys=("uniform", "zipf"))
    with pytest.raises(ConfigError, match=r"--fresh-contenders.*\['naive'\] not among --contenders"):
        BenchPlan(contenders=("ceiling", "ours"), fresh_contenders=("ours", "naive"))


def test_every_contender_runs_by_default_and_merge_on_read_is_one_of_them() -> None:
    assert BenchPlan().contenders == CONTENDERS
    assert "ours-mor" in CONTENDERS
    assert BenchPlan(contenders=("ours-mor",)).contenders == ("ours-mor",)


def test_workload_is_seeded_and_keeps_each_key_in_seq_order() -> None:
    events = workload(keys=50, events=2_000, delete_share=0.2, value_bytes=16, seed=3)
    assert events == workload(keys=50, events=2_000, delete_share=0.2, value_bytes=16, seed=3)
    assert events != workload(keys=50, events=2_000, delete_share=0.2, value_bytes=16, seed=4)
    last: dict[int, Event] = {}
    for event in events:
        previous = last.get(event.key)
        assert event.seq == (previous.seq + 1 if previous else 1)
        if event.op == "delete":
            assert previous is not None and previous.op == "upsert"  # only live keys are deleted
            assert event.row is None
        else:
            assert event.row is not None and len(event.row["note"]) == 16
        last[event.key] = event
    assert 0.1 < sum(e.op == "delete" for e in events) / len(events) < 0.25


def test_a_prefilled_workload_starts_with_every_key_live() -> None:
    events = workload(keys=1_000, events=500, delete_share=0.5, value_bytes=8, seed=1, prefilled=True, first_key=900)
    assert all(900 <= e.key < 1_000 for e in events)
    first = {}
    for event in events:
        first.setdefault(event.key, event)
    assert all(e.seq == 2 for e in first.values())  # newer than the prefill's seq
    assert any(e.op == "delete" for e in first.values())  # a key's first change may delete it


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([1.0, 9.0], 99) == 9.0


def test_freshness_is_send_to_end_of_the_batch_that_read_the_record() -> None:
    def pos(partition: int, offset: int) -> SimpleNamespace:
        return SimpleNamespace(topic="t", partition=partition, offset=offset)

    batches = [
        {"batch_id": 1, "end": 20.0, "ends": {("t", 0): 5, ("t", 1): 3}},
        {"batch_id": 0, "end": 12.0, "ends": {("t", 0): 2, ("t", 1): 1}},
    ]
    sent = [(10.0, pos(0, 0)), (10.5, pos(0, 1)), (11.0, pos(0, 4)), (11.5, pos(1, 2)), (12.0, pos(1, 3))]
    assert freshness_lags(sent, batches) == [2.0, 1.5, 9.0, 8.5]  # offset 3 of partition 1 not read yet


def test_ratios_divide_figures_of_the_same_run() -> None:
    report = {
        "catch_up": {
            "ceiling": {"events_per_s": 1000.0},
            "naive": {"events_per_s": 100.0},
            "ours": {"events_per_s": 400.0},
            "ours-mor": {"events_per_s": 600.0},
            "ceiling_bulk": {"events_per_s": 2000.0},
            "rebuild": {"events_per_s": 1800.0},
            "naive_bulk": {"events_per_s": 2400.0},
        },
        "growth": {"uniform": {"100000": {"batch_p50_s": 2.0}, "10000000": {"batch_p50_s": 3.0}}},
        "growth_mor": {
            "uniform": {
                "100000": {"batch_p50_s": 1.0, "fold_s": 2.0},
                "10000000": {"batch_p50_s": 1.1, "fold_s": 10.0},
            }
        },
    }
    assert ratios(report) == {
        "ours_vs_ceiling": 0.4,
        "ours_vs_naive": 4.0,
        "ours_vs_peer": None,
        "ours_mor_vs_ceiling": 0.6,
        "ours_mor_vs_naive": 6.0,
        "ours_mor_vs_peer": None,
        "best_vs_ceiling": 0.6,
        "best_vs_naive": 6.0,
        "best_vs_peer": None,
        "rebuild_vs_ceiling": 0.9,
        "naive_bulk_vs_ceiling": 1.2,
        "rebuild_vs_naive_bulk": 0.75,
        "growth_uniform_largest_vs_smallest": 1.5,
        "growth_mor_uniform_largest_vs_smallest": 1.1,
        "growth_mor_uniform_fold_largest_vs_smallest": 5.0,
    }


def test_best_is_the_faster_of_ours_and_freshness_is_compared_with_the_ceiling() -> None:
    report = {
        "catch_up": {"ceiling": {"events_per_s": 1000.0}, "ours": {"events_per_s": 500.0}},
        "freshness": {
            "ceiling": {"fresh_p99_s": 0.5},
            "ours": {"fresh_p99_s": 1.0},
            "ours-mor": {"fresh_p99_s": 0.75},
        },
    }
    result = ratios(report)
    assert result["best_vs_ceiling"] == result["ours_vs_ceiling"] == 0.5  # ours-mor did not run
    assert result["ours_mor_vs_ceiling"] is None
    assert result["ours_fresh_p99_vs_ceiling"] == 2.0
    assert result["ours_mor_fresh_p99_vs_ceiling"] == 1.5
    assert "ours_fresh_p99_vs_ceiling" not in ratios({"catch_up": report["catch_up"]})


def test_the_summary_shows_both_layouts_and_their_readers() -> None:
    run = {"events_per_s": 500.0, "batch_p50_s": 1.0, "batch_p99_s": 2.0}
    report = {
        "catch_up": {
            "ours": {**run, "stop_s": 0.01},
            "ours-mor": {**run, "stages_p50_s": {"orders: log": 0.4}, "stop_s": 4.99},
        },
        "readers": {
            "ours": {"rows": 10, "aggregate_s": 0.41, "point_s": 0.2},
            "ours-mor": {
                "pending_changes": 7,
                "pending": {"rows": 10, "aggregate_s": 0.9, "point_s": 0.5},
                "fold_s": 2.3,
                "folded_keys": 7,
                "folded": {"rows": 10, "aggregate_s": 0.4, "point_s": 0.21},
            },
        },
    }
    report["growth_mor"] = {"uniform": {"100000": {"batch_p50_s": 1.0, "batch_max_s": 1.2, "fold_s": 2.5}}}
    lines = list(summary_lines(report))
    assert "growth, ours-mor, uniform keys,     100,000 rows: batch p50 1.0s, max 1.2s, fold 2.5s" in lines
    assert any(line.startswith("ours-mor ") and "500" in line for line in lines)
    assert "ours-mor, one catch-up batch (p50): orders: log 0.40s" in lines
    assert "catch-up, the stop after the last batch (a fold in flight): ours-mor 4.99s" in lines
    assert (
        "readers (median of 5): ours aggregate 0.41 s, point 0.20 s; ours-mor pending (7 changes) aggregate 0.90 s, "
        "point 0.50 s, folded aggregate 0.40 s, point 0.21 s; fold 2.30 s"
    ) in lines


def test_catch_up_rounds_report_the_median_of_each_rounds_own_ratio() -> None:
    def round_of(ceiling: float, naive: float, mor: float) -> dict[str, dict[str, float]]:
        return {n: {"events_per_s": v} for n, v in (("ceiling", ceiling), ("naive", naive), ("ours-mor", mor))}

    # A slow second round (the machine busy): each ratio is taken within a round, never across two.
    rounds = [round_of(1000.0, 500.0, 700.0), round_of(500.0, 250.0, 300.0), round_of(1000.0, 400.0, 600.0)]
    catch_up = median_round(rounds)
    assert catch_up["naive"] == {"events_per_s": 400.0, "rounds_events_per_s": [500.0, 250.0, 400.0]}
    assert catch_up["ours-mor"]["events_per_s"] == 600.0
    report = {"catch_up": catch_up, "catch_up_rounds": rounds}
    assert round_ratios(report)["ours_mor_vs_naive"] == [1.4, 1.2, 1.5]
    result = ratios(report)
    assert (result["ours_mor_vs_naive"], result["ours_mor_vs_ceiling"], result["best_vs_naive"]) == (1.4, 0.6, 1.4)
    assert result["ours_vs_naive"] is None
    assert "ours_mor_vs_naive: 1.4 (median of 3 rounds: 1.40, 1.20, 1.50)" in list(
        summary_lines({**report, "ratios": result})
    )
    # One round: its own figures, no spread.
    single = {"catch_up": median_round(rounds[:1])}
    assert single["catch_up"]["naive"] == {"events_per_s": 500.0}
    assert round_ratios(single) == {} and ratios(single)["ours_mor_vs_naive"] == 1.4
    with pytest.raises(ConfigError, match=r"--rounds.*at least 1"):
        BenchPlan(rounds=0)


def test_freshness_rounds_report_the_median_of_each_rounds_own_p99_ratio() -> None:
    def round_of(ceiling: float, mor: float) -> dict[str, dict[str, float]]:
        return {"ceiling": {"fresh_p99_s": ceiling}, "ours-mor": {"fresh_p99_s": mor}}

    # Where a fold falls in a round's window sets merge-on-read's tail: one round's ratio is one sample.
    rounds = [round_of(5.0, 9.0), round_of(4.0, 4.8), round_of(6.0, 6.6)]
    fresh = median_round(rounds, "fresh_p99_s")
    assert fresh["ours-mor"] == {"fresh_p99_s": 6.6, "rounds_fresh_p99_s": [9.0, 4.8, 6.6]}
    report = {"catch_up": {}, "freshness": fresh, "freshness_rounds": rounds}
    assert round_ratios(report)["ours_mor_fresh_p99_vs_ceiling"] == [1.8, 1.2, 1.1]
    result = ratios(report)
    assert result["ours_mor_fresh_p99_vs_ceiling"] == 1.2 and result["ours_fresh_p99_vs_ceiling"] is None
