"""Where a replica starts, and whether it may: checkpoint ownership, checkpoint loss, data loss.

* A checkpoint records which replica and topics it belongs to (``_replica.json``); another replica's checkpoint
  is refused, since its offsets would silently skip or repeat this replica's log.
* With no checkpoint (lost or deleted) but tables that already hold replica commits, the replica resumes from the
  offsets recorded in its own Delta commits (the smallest over its tables) instead of replaying from the start.
* If the log no longer holds records the replica has not applied (retention deleted them unread), it refuses to
  start, names what is missing and says how to rebuild, instead of skipping them.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from urllib.parse import urlparse

from pyspark.sql import SparkSession

from replica_lib.config import ReplicaConfig
from replica_lib.errors import CheckpointError, DataLossError, ReplicaError
from replica_lib.progress import (
    Offsets,
    applied_offsets,
    batch_ids,
    last_committed_offsets,
    path_exists,
    read_text,
    write_text,
)
from replica_lib.target import table_exists

logger = logging.getLogger(__name__)

OWNER_FILE = "_replica.json"
LOCK_FILE = "_replica.lock"
_held_locks: dict[str, int] = {}  # checkpoint -> file descriptor, held until this process exits


def lock_checkpoint(cfg: ReplicaConfig) -> None:
    """One running instance per replica: an exclusive lock on a local checkpoint folder.

    The kernel drops the lock when the process dies (even by SIGKILL), so a killed replica never leaves a stale
    lock. Checkpoints on other storage (HDFS, object stores) rely on Spark's own detection of a second writer.
    """
    parsed = urlparse(cfg.checkpoint)
    if parsed.scheme not in ("", "file") or cfg.checkpoint in _held_locks:
        return
    folder = parsed.path if parsed.scheme else cfg.checkpoint
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CheckpointError(
            f"replica {cfg.name} is already running on checkpoint {cfg.checkpoint} ({holder}): run one instance "
            "per replica; stop the other one first"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode())
    _held_locks[cfg.checkpoint] = fd


def claim_checkpoint(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """Refuse a checkpoint that belongs to another replica or other topics; label a new one as ours."""
    owner_path = f"{cfg.checkpoint.rstrip('/')}/{OWNER_FILE}"
    ours = {"replica": cfg.name, "topics": list(cfg.topics), "tables": sorted(t.name for t in cfg.tables)}
    if path_exists(spark, owner_path):
        theirs = json.loads(read_text(spark, owner_path))
        if theirs.get("replica") != cfg.name or theirs.get("topics") != ours["topics"]:
            raise CheckpointError(
                f"checkpoint {cfg.checkpoint} belongs to replica {theirs.get('replica')!r} reading "
                f"{', '.join(theirs.get('topics', []))}, not to {cfg.name!r} reading {', '.join(cfg.topics)} "
                f"({cfg.source_file}): give each replica its own replica.checkpoint folder"
            )
        return
    if batch_ids(spark, f"{cfg.checkpoint.rstrip('/')}/offsets"):
        raise CheckpointError(
            f"checkpoint {cfg.checkpoint} has progress but no {OWNER_FILE}: it was not made by a replica; "
            "use an empty folder for replica.checkpoint"
        )
    write_text(spark, owner_path, json.dumps(ours) + "\n")


def _table_offsets(spark: SparkSession, cfg: ReplicaConfig) -> Offsets | None:
    """Per topic and partition, the smallest offset that every table of the topic has applied."""
    resumed: Offsets = {}
    for topic in cfg.topics:
        per_table = []
        for table in (t for t in cfg.tables if t.topic == topic):
            applied = applied_offsets(spark, table.target) if table_exists(spark, table.target) else None
            if applied is None or applied.replica != cfg.name or topic not in applied.offsets:
                return None  # some table has nothing to resume from: replay from the configured start
            per_table.append(applied.offsets[topic])
        partitions = set().union(*per_table)
        resumed[topic] = {p: min(offsets.get(p, 0) for offsets in per_table) for p in sorted(partitions)}
    return resumed


def starting_offsets(spark: SparkSession, cfg: ReplicaConfig) -> str | None:
    """Spark ``startingOffsets`` JSON when resuming a lost checkpoint from the tables; None otherwise."""
    if batch_ids(spark, f"{cfg.checkpoint.rstrip('/')}/offsets"):
        return None  # the checkpoint knows where to go on
    resumed = _table_offsets(spark, cfg)
    if resumed is None:
        return None
    logger.warning(
        "replica %s: checkpoint %s is new, but its tables have applied the log up to %s: resuming from there "
        "(records below those offsets are not read again)",
        cfg.name,
        cfg.checkpoint,
        json.dumps(resumed),
    )
    return json.dumps({t: {str(p): o for p, o in parts.items()} for t, parts in resumed.items()})


def check_log_still_holds(applied: Offsets, log_start: Offsets, cfg: ReplicaConfig) -> None:
    """Raise :class:`DataLossError` if any partition's log now starts after what the replica has applied."""
    missing = [
        (topic, partition, offset, log_start[topic][partition])
        for topic, parts in sorted(applied.items())
        for partition, offset in sorted(parts.items())
        if log_start.get(topic, {}).get(partition, 0) > offset
    ]
    if missing:
        gaps = "; ".join(f"{t}[{p}] offsets {a}..{s - 1}" for t, p, a, s in missing)
        raise DataLossError(
            f"replica {cfg.name}: the log no longer holds records it has not applied ({gaps}): retention deleted "
            f"them unread. The replica cannot be made exact by going on. Rebuild it: stop it, delete its tables and "
            f"its checkpoint ({cfg.checkpoint}) and run it again to replay the log from the start; the topic must "
            f"be compacted (cleanup.policy=compact) for the replay to hold every key"
        )


def applied_so_far(spark: SparkSession, cfg: ReplicaConfig) -> Offsets | None:
    """How far the replica has applied the log: its checkpoint's last finished batch, else its tables."""
    return last_committed_offsets(spark, cfg.checkpoint) or _table_offsets(spark, cfg)


def explain(exc: BaseException, cfg: ReplicaConfig) -> ReplicaError | None:
    """A clear error for a failure of the query that users meet in operation, or None."""
    text = str(exc)
    if "not available in Kafka any more" in text or "OffsetOutOfRange" in text or "data may have been lost" in text:
        return DataLossError(
            f"replica {cfg.name}: Kafka no longer holds offsets this replica still needs (retention or a topic "
            f"reset deleted them unread), so it stopped instead of skipping them. Rebuild it: stop it, delete "
            f"its tables and its checkpoint ({cfg.checkpoint}) and run it again to replay the log from the start"
        )
    if "Multiple streaming queries are concurrently using" in text or "ConcurrentModification" in text:
        return CheckpointError(
            f"replica {cfg.name}: another instance is running on checkpoint {cfg.checkpoint}; this one stopped. "
            "Run one instance per replica"
        )
    return None
