"""The status's verdict, its table for terminals and its JSON, on statuses built by hand (no broker, no Spark)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from replica_lib.status import PartitionLag, ReplicaStatus, TableStatus, Thresholds, judge, render, to_json

NOW = 1_700_000_000.0


def _table(
    lags: tuple[tuple[int | None, int | None], ...] = ((10, 10), (7, 9)),
    last_commit_s: float | None = NOW - 4,
    problems: tuple[str, ...] = (),
    thresholds: Thresholds | None = None,
    late: int | None = 0,
) -> TableStatus:
    partitions = tuple(
        PartitionLag(p, applied, end, None if end is None else end - (applied or 0))  # nothing applied: from 0
        for p, (applied, end) in enumerate(lags)
    )
    status = TableStatus(
        "orders",
        "orders-topic",
        partitions,
        version=12,
        rows=1000,
        quarantined=3,
        batch_id=11,
        last_commit_s=last_commit_s,
        newest_event_s=NOW - 185,
        late=late,
        problems=problems,
    )
    return judge(status, thresholds or Thresholds(), NOW)


def _replica(*tables: TableStatus, problems: tuple[str, ...] = (), name: str = "orders_a") -> ReplicaStatus:
    return ReplicaStatus(name, f"conf/{name}.toml", NOW, Thresholds(), tables, problems)


def test_lag_is_summed_over_partitions_and_tables() -> None:
    table = _table()

    assert table.lag_records == 2
    assert _replica(table, table).lag_records == 4


def test_within_thresholds_is_healthy() -> None:
    assert _table().healthy
    assert _replica(_table()).healthy


def test_more_records_behind_than_the_threshold_is_unhealthy() -> None:
    table = _table(thresholds=Thresholds(max_lag_records=1))

    assert table.unhealthy == ("2 records behind, over 1",)
    assert not _replica(table).healthy


def test_records_waiting_with_no_recent_commit_is_unhealthy() -> None:
    table = _table(last_commit_s=NOW - 3700, thresholds=Thresholds(max_lag_seconds=60))

    assert table.unhealthy == ("2 records waiting and no commit for 1h01m, over 60s",)


def test_an_idle_log_is_healthy_however_old_the_last_commit() -> None:
    table = _table(lags=((10, 10),), last_commit_s=NOW - 86_400 * 3, thresholds=Thresholds(max_lag_seconds=60))

    assert table.lag_records == 0
    assert table.healthy


def test_unknown_end_offsets_leave_the_lag_unknown_and_the_replica_unhealthy() -> None:
    table = _table(lags=((10, None),))
    replica = _replica(table, problems=("cannot reach Kafka at b1:9092",))

    assert table.lag_records is None
    assert replica.lag_records is None
    assert not replica.healthy


def test_a_table_that_cannot_be_read_is_unhealthy_with_its_reason() -> None:
    table = _table(problems=("no Delta table at delta.`/x` yet: run the replica",))

    assert table.unhealthy == ("no Delta table at delta.`/x` yet: run the replica",)


def test_thresholds_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        Thresholds(max_lag_records=-1)


def test_render_is_an_aligned_table_then_the_reasons() -> None:
    healthy = _replica(_table())
    behind = _replica(_table(thresholds=Thresholds(max_lag_records=0)), name="orders_b")

    lines = render([healthy, behind]).splitlines()

    assert lines == [
        "REPLICA   TABLE   TOPIC         LAG  EVENT AGE  LAST COMMIT  BATCH  VERSION  ROWS  QUAR.  LATE  STATUS",
        "orders_a  orders  orders-topic    2  3m05s      4s ago          11       12  1000      3     0  ok",
        "orders_b  orders  orders-topic    2  3m05s      4s ago          11       12  1000      3     0  UNHEALTHY",
        "orders_b.orders: 2 records behind, over 0",
    ]


def test_late_changes_are_shown_and_noted_but_leave_a_table_healthy() -> None:
    table = _table(late=4)

    lines = render([_replica(table)]).splitlines()

    assert table.healthy
    assert lines[1].split()[-2:] == ["4", "ok"]
    assert lines[2].startswith("orders_a.orders: 4 late changes seen (a lower seq written after a higher one")
    assert json.loads(to_json([_replica(table)]))["replicas"][0]["tables"][0]["late_changes"] == 4


def test_render_with_partitions_shows_each_partition() -> None:
    lines = render([_replica(_table(lags=((10, 10), (None, 5))))], partitions=True).splitlines()

    assert [line.split() for line in lines[2:]] == [
        ["[0]", "0", "applied", "10", "end", "10"],
        ["[1]", "5", "applied", "-", "end", "5"],
    ]


def test_render_unknowns_as_dashes() -> None:
    table = judge(TableStatus("orders", "t", (PartitionLag(0, None, None, None),)), Thresholds(), NOW)

    row = render([_replica(table, problems=("cannot reach Kafka",))]).splitlines()[1]

    assert row.split() == ["orders_a", "orders", "t", "-", "-", "-", "-", "-", "-", "-", "-", "UNHEALTHY"]


def test_json_has_every_figure_with_times_in_utc() -> None:
    doc = json.loads(to_json([_replica(_table()), _replica(_table(lags=((0, 5),)), name="orders_b")]))

    assert doc["healthy"] is True
    first = doc["replicas"][0]
    assert {k: first[k] for k in ("replica", "file", "healthy", "lag_records", "problems")} == {
        "replica": "orders_a",
        "file": "conf/orders_a.toml",
        "healthy": True,
        "lag_records": 2,
        "problems": [],
    }
    assert first["checked_at"] == "2023-11-14T22:13:20.000+00:00"
    assert first["thresholds"] == {"max_lag_records": 10_000, "max_lag_seconds": 300.0}
    assert first["tables"] == [
        {
            "table": "orders",
            "topic": "orders-topic",
            "healthy": True,
            "unhealthy": [],
            "problems": [],
            "lag_records": 2,
            "partitions": [
                {"partition": 0, "applied": 10, "end": 10, "lag": 0},
                {"partition": 1, "applied": 7, "end": 9, "lag": 2},
            ],
            "version": 12,
            "rows": 1000,
            "quarantined": 3,
            "batch_id": 11,
            "last_commit_at": "2023-11-14T22:13:16.000+00:00",
            "since_commit_s": 4.0,
            "newest_event_at": "2023-11-14T22:10:15.000+00:00",
            "event_age_s": 185.0,
            "late_changes": 0,
            "fields_not_kept": {},
        }
    ]
    assert doc["replicas"][1]["lag_records"] == 5


def test_json_is_unhealthy_if_any_replica_is() -> None:
    doc = json.loads(to_json([_replica(_table()), _replica(_table(problems=("x",)), name="orders_b")]))

    assert doc["healthy"] is False
    assert [r["healthy"] for r in doc["replicas"]] == [True, False]


def test_fields_not_kept_are_noted_and_in_the_json() -> None:
    table = replace(_table(), fields_not_kept={"note": 40, "meta": 2})

    lines = render([_replica(table)]).splitlines()

    assert table.healthy
    assert lines[2] == (
        "orders_a.orders: fields the table does not keep were sent: meta (2 records), note (40 records); declare "
        "them in the schema to keep them (see the README's Schema evolution)"
    )
    tables = json.loads(to_json([_replica(table)]))["replicas"][0]["tables"]
    assert tables[0]["fields_not_kept"] == {"note": 40, "meta": 2}
