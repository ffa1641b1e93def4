"""The reference model: fold change events per key in log order. What every replica table must equal.

It is deliberately written without Spark, as plainly as possible, from the rules in :mod:`replica_lib.ordering`:
a change applies if its version ``(seq, partition, offset)`` is greater than the key's current version; a
tombstone takes the seq of the state it deletes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from replica_lib.producer import Change, Position

_MIN = -(2**63)


@dataclass(frozen=True)
class LoggedChange:
    """A change as the log holds it."""

    position: Position
    change: Change
    table: str


def _newer(a: tuple[int | None, int, int], b: tuple[int | None, int, int] | None) -> bool:
    if b is None:
        return True
    return (a[0] if a[0] is not None else _MIN, a[1], a[2]) > (b[0] if b[0] is not None else _MIN, b[1], b[2])


def fold(
    events: Iterable[LoggedChange],
    keys: Mapping[str, tuple[str, ...]],
    sequenced: Mapping[str, bool],
) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
    """Live rows per table and key, each with its provenance columns (``_src_*``).

    ``events`` may come in any order; each key's events are folded by log position. ``sequenced[table]`` says
    whether the table orders by seq (otherwise seqs are ignored and the log position decides).
    """
    state: dict[tuple[str, tuple[Any, ...]], tuple[tuple[int | None, int, int], dict[str, Any] | None]] = {}
    ordered = sorted(events, key=lambda e: (e.position.topic, e.position.partition, e.position.offset))
    for event in ordered:
        change, pos = event.change, event.position
        key = tuple(change.key[k] for k in keys[event.table])
        slot = (event.table, key)
        current = state.get(slot)
        if change.tombstone:
            seq = current[0][0] if current else None
        else:
            seq = change.seq if sequenced[event.table] else None
        version = (seq, pos.partition, pos.offset)
        if not _newer(version, current[0] if current else None):
            continue
        row = None
        if change.op == "upsert":
            assert change.data is not None
            row = dict(change.data) | {
                "_src_topic": pos.topic,
                "_src_partition": pos.partition,
                "_src_offset": pos.offset,
                "_src_seq": seq,
            }
        state[slot] = (version, row)
    result: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {table: {} for table in keys}
    for (table, key), (_, row) in state.items():
        if row is not None:
            result[table][key] = row
    return result
