"""replica_dev.loadgen.generate: the seeded demo workload (no I/O)."""

from __future__ import annotations

from typing import Any

import pytest

from replica_dev.loadgen import Workload, generate
from replica_dev.model import LoggedChange, fold
from replica_lib.producer import Change, Position

CHURN = Workload(keys=5, events=400, update_share=0.3, delete_share=0.3, seed=11)


def test_generate_is_deterministic_for_a_seed() -> None:
    first = generate(CHURN)
    assert first == generate(Workload(keys=5, events=400, update_share=0.3, delete_share=0.3, seed=11))
    assert first != generate(Workload(keys=5, events=400, update_share=0.3, delete_share=0.3, seed=12))
    assert len(first) == 400


def test_no_events_gives_no_changes() -> None:
    assert generate(Workload(events=0)) == []


def test_first_changes_insert_new_orders() -> None:
    changes = generate(Workload(keys=3, events=1, seed=1))
    assert len(changes) == 1
    (change,) = changes
    assert change.op == "upsert"
    assert change.key == {"order_id": 1}
    assert change.seq == 1
    assert change.table is None
    assert change.data is not None
    assert set(change.data) == {"order_id", "customer", "status", "amount", "updated_ms"}
    assert change.data["status"] == "new"
    assert change.data["updated_ms"] == change.ts_ms


def test_seq_is_strictly_increasing_per_key_and_time_moves_forward() -> None:
    last_seq: dict[Any, int] = {}
    last_ts = 0
    for change in generate(CHURN):
        order_id = change.key["order_id"]
        assert change.seq == last_seq.get(order_id, 0) + 1
        last_seq[order_id] = change.seq
        assert change.ts_ms is not None
        assert change.ts_ms > last_ts
        last_ts = change.ts_ms
    assert sorted(last_seq) == [1, 2, 3, 4, 5]  # never more keys than asked for


def test_deletes_hit_live_keys_and_deleted_keys_come_back() -> None:
    live: dict[Any, dict[str, Any]] = {}
    reinserted = 0
    deletes = 0
    seen: set[Any] = set()
    for change in generate(CHURN):
        order_id = change.key["order_id"]
        assert change.tombstone is False
        if change.op == "delete":
            assert order_id in live, f"delete of {order_id}, which is not live"
            assert change.data is None
            del live[order_id]
            deletes += 1
            continue
        assert change.data is not None
        assert change.data["order_id"] == order_id
        if order_id not in live:
            assert change.data["status"] == "new"
            reinserted += order_id in seen
        live[order_id] = dict(change.data)
        seen.add(order_id)
    assert deletes > 0
    assert reinserted > 0


def test_updates_advance_the_status_of_the_live_row() -> None:
    statuses = ("new", "paid", "packed", "shipped", "delivered")
    live: dict[Any, Any] = {}
    updates = 0
    for change in generate(CHURN):
        order_id = change.key["order_id"]
        if change.op == "delete":
            live.pop(order_id)
            continue
        assert change.data is not None
        previous = live.get(order_id)
        if previous is not None:
            updates += 1
            assert change.data["customer"] == previous["customer"]
            expected = statuses[min(statuses.index(previous["status"]) + 1, len(statuses) - 1)]
            assert change.data["status"] == expected
        live[order_id] = change.data
    assert updates > 0


def test_generated_log_folds_to_the_live_rows() -> None:
    changes = generate(Workload(keys=4, events=60, update_share=0.4, delete_share=0.3, seed=5, table="orders"))
    assert {c.table for c in changes} == {"orders"}
    live: dict[tuple[Any, ...], dict[str, Any]] = {}
    logged = []
    for offset, change in enumerate(changes):
        logged.append(LoggedChange(Position("orders", 0, offset), change, "orders"))
        key = (change.key["order_id"],)
        if change.op == "delete":
            live.pop(key)
        else:
            assert change.data is not None
            live[key] = {
                **change.data,
                "_src_topic": "orders",
                "_src_partition": 0,
                "_src_offset": offset,
                "_src_seq": change.seq,
            }
    assert fold(logged, {"orders": ("order_id",)}, {"orders": True}) == {"orders": live}


def test_changes_are_independent_copies() -> None:
    changes = generate(CHURN)
    by_key: dict[Any, Change] = {}
    for change in changes:
        previous = by_key.get(change.key["order_id"])
        if previous is not None and previous.data is not None and change.data is not None:
            assert previous.data is not change.data
        by_key[change.key["order_id"]] = change
    assert changes == generate(CHURN)  # generating again did not mutate anything already handed out


SHARES = "update_share and delete_share must be >= 0 and leave room for inserts (sum < 1)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keys": 0}, "keys must be >= 1 and events >= 0"),
        ({"events": -1}, "keys must be >= 1 and events >= 0"),
        ({"update_share": -0.1}, SHARES),
        ({"delete_share": -0.1}, SHARES),
        ({"update_share": 0.6, "delete_share": 0.4}, SHARES),
        ({"rate": 0}, "rate must be positive"),
        ({"rate": -1.0}, "rate must be positive"),
    ],
)
def test_workload_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        Workload(**kwargs)
    assert str(info.value) == message


def test_workload_accepts_boundaries() -> None:
    assert Workload(keys=1, events=0, update_share=0.0, delete_share=0.0, rate=0.5).rate == 0.5
