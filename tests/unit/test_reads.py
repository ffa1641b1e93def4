"""Write positions as the CLI takes them, and the per-batch metrics record (pure parts; the rest is integration)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replica_lib.batch import BatchStats
from replica_lib.metrics import METRICS_SCHEMA, _row, metrics_record
from replica_lib.producer import Position
from replica_lib.reads import parse_position


@pytest.mark.parametrize(
    ("text", "position"),
    [
        ("orders:0:7275", Position("orders", 0, 7275)),
        ("orders.v2:11:0", Position("orders.v2", 11, 0)),
        ("ns:orders:3:12", Position("ns:orders", 3, 12)),  # a topic name cannot hold ':', but the split is from the end
    ],
)
def test_positions_are_topic_partition_offset(text: str, position: Position) -> None:
    assert parse_position(text) == position


@pytest.mark.parametrize("text", ["orders", "orders:1", "orders:x:1", ":0:1", "orders:0:-1", "orders:-1:3", ""])
def test_a_malformed_position_says_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match="expected topic:partition:offset"):
        parse_position(text)


def _progress(**metrics: str) -> SimpleNamespace:
    return SimpleNamespace(
        id="4b1c",
        timestamp="2026-11-23T10:00:00.000Z",
        inputRowsPerSecond=float("nan"),
        processedRowsPerSecond=250.0,
        durationMs={"triggerExecution": 1200},
        sources=[SimpleNamespace(metrics=metrics)],
    )


def test_a_record_joins_the_handlers_figures_with_sparks_report() -> None:
    stats = BatchStats(
        batch_id=4,
        records=300,
        upserts=200,
        deletes=40,
        quarantined=5,
        seconds=1.23456,
        offsets={"orders": {1: 150, 0: 160}},
        stages={"decode": 0.5},
    )
    behind = {"minOffsetsBehindLatest": "0", "avgOffsetsBehindLatest": "10.5", "maxOffsetsBehindLatest": "21"}
    record = metrics_record("orders_a", stats, _progress(**behind))
    assert record["unchanged"] == 55
    assert record["offsets"] == {"orders": {"0": 160, "1": 150}}
    assert (record["offsets_behind_min"], record["offsets_behind_avg"], record["offsets_behind_max"]) == (0, 10.5, 21)
    assert record["input_rows_per_second"] is None  # NaN (no previous trigger) is not a figure
    assert record["trigger_ms"] == 1200
    assert record["seconds"] == 1.235
    row = _row(record)
    assert len(row) == len(METRICS_SCHEMA.fields)
    assert dict(zip(METRICS_SCHEMA.fieldNames(), row, strict=True))["offsets"] == {"orders": {0: 160, 1: 150}}


def test_a_report_without_the_lag_metrics_gives_none() -> None:
    record = metrics_record("orders_a", BatchStats(batch_id=0), _progress())
    assert record["offsets_behind_max"] is None
    assert record["unchanged"] == 0
