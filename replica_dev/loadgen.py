"""A demo primary service: an "orders" service writing a seeded mix of inserts, updates and deletes."""

from __future__ import annotations

import bisect
import logging
import random
import time
from dataclasses import dataclass

from replica_dev.model import LoggedChange
from replica_lib.producer import Change, ChangeProducer

logger = logging.getLogger(__name__)

STATUSES = ("new", "paid", "packed", "shipped", "delivered")
CUSTOMERS = ("ada", "grace", "edsger", "barbara", "donald", "leslie", "margaret", "ken")


@dataclass(frozen=True)
class Workload:
    """What the load generator writes: ``events`` changes over at most ``keys`` orders."""

    keys: int = 200
    events: int = 2_000
    update_share: float = 0.6
    delete_share: float = 0.1
    rate: float | None = None  # events per second; None = as fast as possible
    seed: int = 7
    table: str | None = None  # set the envelope's table field

    def __post_init__(self) -> None:
        if self.keys < 1 or self.events < 0:
            raise ValueError("keys must be >= 1 and events >= 0")
        if not (self.update_share >= 0 and self.delete_share >= 0 and self.update_share + self.delete_share < 1):
            raise ValueError("update_share and delete_share must be >= 0 and leave room for inserts (sum < 1)")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")


def generate(workload: Workload) -> list[Change]:
    """The seeded sequence of changes (no I/O): the same workload always gives the same changes."""
    rng = random.Random(workload.seed)
    live: dict[int, dict[str, object]] = {}
    versions: dict[int, int] = {}
    # The live and the deleted keys, each kept sorted as it changes: a choice among them costs no sort per event.
    live_keys: list[int] = []
    deleted: list[int] = []
    next_id = 1
    changes = []
    now_ms = 1_700_000_000_000
    for _ in range(workload.events):
        now_ms += rng.randint(1, 50)
        roll = rng.random()
        if live and roll < workload.delete_share:
            op, order_id = "delete", rng.choice(live_keys)
        elif live and roll < workload.delete_share + workload.update_share:
            op, order_id = "update", rng.choice(live_keys)
        elif next_id <= workload.keys:
            op, order_id, next_id = "insert", next_id, next_id + 1
        elif deleted:
            op, order_id = "insert", rng.choice(deleted)  # the primary re-creates a deleted order
        else:
            op, order_id = "update", rng.choice(live_keys)
        seq = versions.get(order_id, 0) + 1
        versions[order_id] = seq
        key = {"order_id": order_id}
        if op == "delete":
            live.pop(order_id)
            live_keys.pop(bisect.bisect_left(live_keys, order_id))
            bisect.insort(deleted, order_id)
            changes.append(Change(key=key, op="delete", seq=seq, ts_ms=now_ms, table=workload.table))
            continue
        if order_id not in live:
            bisect.insort(live_keys, order_id)
            index = bisect.bisect_left(deleted, order_id)
            if index < len(deleted) and deleted[index] == order_id:
                deleted.pop(index)
        row = live.get(order_id) or {
            "order_id": order_id,
            "customer": rng.choice(CUSTOMERS),
            "status": "new",
            "amount": round(rng.uniform(5, 500), 2),
        }
        if op == "update":
            row = dict(row)
            row["status"] = STATUSES[min(STATUSES.index(str(row["status"])) + 1, len(STATUSES) - 1)]
            row["amount"] = round(float(row["amount"]) * rng.uniform(0.9, 1.1), 2)  # type: ignore[arg-type]
        row["updated_ms"] = now_ms
        live[order_id] = row
        changes.append(Change(key=key, op="upsert", data=dict(row), seq=seq, ts_ms=now_ms, table=workload.table))
    return changes


def run(producer: ChangeProducer, topic: str, workload: Workload, table: str = "orders") -> list[LoggedChange]:
    """Write the workload to ``topic``; returns every change with its acknowledged position, in send order."""
    changes = generate(workload)
    deliveries = []
    started = last_report = time.monotonic()
    for i, change in enumerate(changes, start=1):
        deliveries.append(producer.send(topic, change))
        if workload.rate is not None:
            ahead = started + i / workload.rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)  # pacing the demo primary, not synchronisation
        if time.monotonic() - last_report >= 5:
            last_report = time.monotonic()
            logger.info("produced %d/%d changes to %s", i, len(changes), topic)
    producer.flush()
    logged = [LoggedChange(d.result(), c, table) for d, c in zip(deliveries, changes, strict=True)]
    elapsed = time.monotonic() - started
    logger.info(
        "produced %d changes to %s in %.1fs (%.0f/s)",
        len(logged),
        topic,
        elapsed,
        len(logged) / elapsed if elapsed else 0,
    )
    return logged
