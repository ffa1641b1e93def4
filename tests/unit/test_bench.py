"""The benchmark's pure parts: its arguments, its workload and its figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replica_dev.bench import BenchPlan, Event, freshness_lags, percentile, ratios, workload
from replica_lib.errors import ConfigError


def test_bad_arguments_name_the_flag_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"--batch-size.*at least 1"):
        BenchPlan(batch_size=0)
    with pytest.raises(ConfigError, match=r"--contenders.*unknown \['fastest'\]"):
        BenchPlan(contenders=("ours", "fastest"))
    with pytest.raises(ConfigError, match="--delete-share"):
        BenchPlan(delete_share=1.5)


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
            "ceiling_bulk": {"events_per_s": 2000.0},
            "rebuild": {"events_per_s": 1800.0},
        },
        "growth": {"uniform": {"100000": {"batch_p50_s": 2.0}, "10000000": {"batch_p50_s": 3.0}}},
    }
    assert ratios(report) == {
        "ours_vs_ceiling": 0.4,
        "ours_vs_naive": 4.0,
        "ours_vs_peer": None,
        "rebuild_vs_ceiling": 0.9,
        "growth_uniform_largest_vs_smallest": 1.5,
    }
