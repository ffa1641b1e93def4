"""replica_dev.model.fold: the reference model every replica table must equal."""

from __future__ import annotations

import random
from typing import Any

from replica_dev.model import LoggedChange, fold
from replica_lib.producer import Change, Position

KEYS = {"orders": ("order_id",)}
SEQUENCED = {"orders": True}
UNSEQUENCED = {"orders": False}


def up(offset: int, order_id: int, seq: int | None, status: str, partition: int = 0) -> LoggedChange:
    data = {"order_id": order_id, "status": status}
    change = Change(key={"order_id": order_id}, op="upsert", data=data, seq=seq)
    return LoggedChange(Position("orders", partition, offset), change, "orders")


def delete(offset: int, order_id: int, seq: int | None, partition: int = 0) -> LoggedChange:
    change = Change(key={"order_id": order_id}, op="delete", seq=seq)
    return LoggedChange(Position("orders", partition, offset), change, "orders")


def tombstone(offset: int, order_id: int, partition: int = 0) -> LoggedChange:
    change = Change(key={"order_id": order_id}, op="delete", tombstone=True)
    return LoggedChange(Position("orders", partition, offset), change, "orders")


def row(order_id: int, status: str, offset: int, seq: int | None, partition: int = 0) -> dict[str, Any]:
    return {
        "order_id": order_id,
        "status": status,
        "_src_topic": "orders",
        "_src_partition": partition,
        "_src_offset": offset,
        "_src_seq": seq,
    }


def live(events: list[LoggedChange], sequenced: dict[str, bool] = SEQUENCED) -> dict[tuple[Any, ...], dict[str, Any]]:
    return fold(events, KEYS, sequenced)["orders"]


def test_empty_log_gives_empty_tables() -> None:
    assert fold([], {"orders": ("order_id",), "lines": ("id",)}, {"orders": True, "lines": False}) == {
        "orders": {},
        "lines": {},
    }


def test_last_by_seq_wins_for_many_events_of_one_key() -> None:
    events = [up(0, 1, 1, "new"), up(1, 1, 2, "paid"), up(2, 2, 1, "new"), up(3, 1, 3, "shipped")]
    assert live(events) == {(1,): row(1, "shipped", 3, 3), (2,): row(2, "new", 2, 1)}


def test_events_are_folded_in_log_order_whatever_order_they_are_given_in() -> None:
    events = [
        up(0, 1, 1, "new"),
        up(1, 1, 2, "paid"),
        tombstone(2, 2),
        up(3, 2, 1, "new"),
        up(4, 1, 3, "shipped"),
    ]
    shuffled = list(events)
    random.Random(3).shuffle(shuffled)
    assert shuffled != events
    assert live(shuffled) == live(events) == {(1,): row(1, "shipped", 4, 3), (2,): row(2, "new", 3, 1)}


def test_older_seq_later_in_the_log_does_not_overwrite() -> None:
    events = [up(0, 1, 5, "paid"), up(1, 1, 3, "new"), up(2, 1, 4, "late")]
    assert live(events) == {(1,): row(1, "paid", 0, 5)}


def test_equal_seq_later_in_the_log_wins_so_duplicates_are_harmless() -> None:
    # The same change delivered at two offsets (a producer retry without idempotence): same row, later offset.
    events = [
        up(0, 1, 1, "new"),
        up(1, 1, 2, "paid"),
        up(2, 1, 2, "paid"),
        up(3, 2, 1, "new"),
        up(4, 2, 1, "new"),
    ]
    assert live(events) == {(1,): row(1, "paid", 2, 2), (2,): row(2, "new", 4, 1)}


def test_delete_then_older_late_upsert_stays_deleted() -> None:
    events = [up(0, 1, 1, "new"), delete(1, 1, 3), up(2, 1, 2, "paid")]
    assert live(events) == {}


def test_delete_with_equal_seq_later_in_the_log_still_deletes() -> None:
    assert live([up(0, 1, 2, "new"), delete(1, 1, 2)]) == {}


def test_delete_of_an_unseen_key_blocks_older_upserts() -> None:
    assert live([delete(0, 1, 5), up(1, 1, 4, "late"), up(2, 2, 1, "new")]) == {(2,): row(2, "new", 2, 1)}


def test_delete_then_newer_upsert_reinserts() -> None:
    events = [up(0, 1, 1, "new"), delete(1, 1, 2), up(2, 1, 3, "again")]
    assert live(events) == {(1,): row(1, "again", 2, 3)}


def test_older_delete_does_not_remove_a_newer_row() -> None:
    assert live([up(0, 1, 5, "paid"), delete(1, 1, 4)]) == {(1,): row(1, "paid", 0, 5)}


def test_tombstone_deletes_and_inherits_the_deleted_states_seq() -> None:
    base = [up(0, 1, 5, "paid"), tombstone(1, 1)]
    assert live(base) == {}
    assert live([*base, up(2, 1, 4, "late")]) == {}  # smaller seq than the deleted state: no resurrection
    assert live([*base, up(2, 1, 5, "same")]) == {(1,): row(1, "same", 2, 5)}  # equal seq, later in the log
    assert live([*base, up(2, 1, 6, "newer")]) == {(1,): row(1, "newer", 2, 6)}


def test_tombstone_after_a_delete_keeps_the_delete_seq() -> None:
    events = [up(0, 1, 1, "new"), delete(1, 1, 7), tombstone(2, 1), up(3, 1, 6, "late")]
    assert live(events) == {}
    assert live([*events, up(4, 1, 8, "back")]) == {(1,): row(1, "back", 4, 8)}


def test_tombstone_of_an_unseen_key_lets_any_later_upsert_in() -> None:
    assert live([tombstone(0, 1), up(1, 1, 1, "new")]) == {(1,): row(1, "new", 1, 1)}


def test_tombstone_inherits_the_greatest_seq_not_the_latest_one() -> None:
    # seq 9 wins over the later seq 3; the tombstone deletes the seq-9 state, so seq 8 must not resurrect it.
    events = [up(0, 1, 9, "paid"), up(1, 1, 3, "old"), tombstone(2, 1), up(3, 1, 8, "late")]
    assert live(events) == {}


def test_unsequenced_table_uses_pure_log_order() -> None:
    events = [
        up(0, 1, 5, "first"),
        up(1, 1, 2, "second"),  # seq ignored: a later record wins
        up(2, 2, 9, "new"),
        delete(3, 2, 1),
        up(4, 3, 1, "new"),
        tombstone(5, 3),
        up(6, 3, None, "back"),
        up(7, 4, 1, "new"),
        up(8, 4, 1, "dup"),
    ]
    assert live(events, UNSEQUENCED) == {
        (1,): row(1, "second", 1, None),
        (3,): row(3, "back", 6, None),
        (4,): row(4, "dup", 8, None),
    }


def test_partition_breaks_ties_between_equal_seqs() -> None:
    events = [up(7, 1, 2, "p1", partition=1), up(3, 1, 2, "p0", partition=0)]
    assert live(events) == {(1,): row(1, "p1", 7, 2, partition=1)}


def test_provenance_comes_from_the_winning_change_and_keys_may_be_composite() -> None:
    keys = {"lines": ("order_id", "line")}

    def line(topic: str, partition: int, offset: int, line_no: int, seq: int, sku: str) -> LoggedChange:
        key = {"order_id": 1, "line": line_no}
        change = Change(key=key, op="upsert", data={**key, "sku": sku}, seq=seq, ts_ms=1_000, table="lines")
        return LoggedChange(Position(topic, partition, offset), change, "lines")

    events = [line("t", 2, 10, 1, 4, "a"), line("t", 2, 11, 2, 1, "b"), line("t", 2, 12, 1, 3, "c")]
    assert fold(events, keys, {"lines": True}) == {
        "lines": {
            (1, 1): {
                "order_id": 1,
                "line": 1,
                "sku": "a",
                "_src_topic": "t",
                "_src_partition": 2,
                "_src_offset": 10,
                "_src_seq": 4,
            },
            (1, 2): {
                "order_id": 1,
                "line": 2,
                "sku": "b",
                "_src_topic": "t",
                "_src_partition": 2,
                "_src_offset": 11,
                "_src_seq": 1,
            },
        }
    }


def test_tables_fold_independently() -> None:
    keys = {"orders": ("order_id",), "lines": ("order_id",)}
    order = up(0, 1, 2, "paid")
    line_delete = LoggedChange(Position("orders", 0, 1), Change(key={"order_id": 1}, op="delete", seq=9), "lines")
    assert fold([order, line_delete], keys, {"orders": True, "lines": True}) == {
        "orders": {(1,): row(1, "paid", 0, 2)},
        "lines": {},
    }
