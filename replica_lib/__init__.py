"""replica: exact, rebuildable replicas of primary services' state, with Kafka as the log and Spark + Delta.

The public surface. A replica job loads its file, builds the session and runs the replica::

    from replica_lib import build_session, load_replica, local_settings, run_replica

    cfg = load_replica("conf/orders_a.toml")
    run_replica(build_session(f"replica-{cfg.name}", local_settings()), cfg)

A primary service writes its changes with :class:`ChangeProducer` (it never needs Spark: names are imported on
first use, so ``from replica_lib import ChangeProducer`` does not load pyspark). Everything else in the package
is internal and may change.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replica_lib.batch import BatchHooks, BatchStats
    from replica_lib.catalog import register_catalog
    from replica_lib.config import LocalSettings, ReplicaConfig, load_replica, local_settings
    from replica_lib.errors import ReplicaError
    from replica_lib.maintenance import maintain
    from replica_lib.producer import Change, ChangeProducer, Delivery, Position, ProducerSettings
    from replica_lib.quarantine import reasons
    from replica_lib.reads import Snapshot, freshest, snapshot_at, wait_for
    from replica_lib.rebuild import rebuild
    from replica_lib.replay import replay
    from replica_lib.session import build_session
    from replica_lib.status import replica_status, status_of
    from replica_lib.stream import run_replica, start_replica
    from replica_lib.topics import TopicAdmin, TopicSpec
    from replica_lib.verify import compare_tables

_WHERE = {
    "BatchHooks": "batch",
    "BatchStats": "batch",
    "register_catalog": "catalog",
    "LocalSettings": "config",
    "ReplicaConfig": "config",
    "load_replica": "config",
    "local_settings": "config",
    "ReplicaError": "errors",
    "maintain": "maintenance",
    "Change": "producer",
    "ChangeProducer": "producer",
    "Delivery": "producer",
    "Position": "producer",
    "ProducerSettings": "producer",
    "reasons": "quarantine",
    "replay": "replay",
    "Snapshot": "reads",
    "freshest": "reads",
    "snapshot_at": "reads",
    "wait_for": "reads",
    "replica_status": "status",
    "status_of": "status",
    "rebuild": "rebuild",
    "compare_tables": "verify",
    "build_session": "session",
    "run_replica": "stream",
    "start_replica": "stream",
    "TopicAdmin": "topics",
    "TopicSpec": "topics",
}

__all__ = [
    "BatchHooks",
    "BatchStats",
    "Change",
    "ChangeProducer",
    "Delivery",
    "LocalSettings",
    "Position",
    "ProducerSettings",
    "ReplicaConfig",
    "ReplicaError",
    "Snapshot",
    "TopicAdmin",
    "TopicSpec",
    "build_session",
    "compare_tables",
    "freshest",
    "load_replica",
    "local_settings",
    "maintain",
    "reasons",
    "rebuild",
    "register_catalog",
    "replay",
    "replica_status",
    "run_replica",
    "snapshot_at",
    "start_replica",
    "status_of",
    "wait_for",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'replica_lib' has no attribute {name!r}")
    return getattr(importlib.import_module(f"replica_lib.{_WHERE[name]}"), name)
