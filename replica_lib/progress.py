"""How far a replica has applied the log: from the Spark checkpoint, and from the Delta commits themselves."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F

from replica_lib.config import Target
from replica_lib.errors import ChecksumError, jvm_causes
from replica_lib.session import java_class

logger = logging.getLogger(__name__)

#: topic -> partition -> next offset to read (Spark's convention: the end offset is exclusive).
Offsets = dict[str, dict[int, int]]


def offsets_json(offsets: Offsets) -> dict[str, dict[str, int]]:
    """``offsets`` as JSON takes them (partition numbers as strings), topics and partitions in order."""
    return {t: {str(p): o for p, o in sorted(parts.items())} for t, parts in sorted(offsets.items())}


def parse_offsets(data: Mapping[str, Mapping[str, Any]]) -> Offsets:
    """The inverse of :func:`offsets_json` (also reads Spark's offset log and commit metadata)."""
    return {t: {int(p): int(o) for p, o in parts.items()} for t, parts in data.items()}


def _fs(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """(Hadoop FileSystem, Path) for ``path``: checkpoints may live on any storage Spark can use."""
    hadoop_path = java_class(spark, "org.apache.hadoop.fs.Path")(path)
    return hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hadoop_path


def path_exists(spark: SparkSession, path: str) -> bool:
    fs, hadoop_path = _fs(spark, path)
    return bool(fs.exists(hadoop_path))


def remove_if_uncommitted(spark: SparkSession, path: str) -> bool:
    """Delete the folder ``path`` if it holds no file at any depth but hidden ones (names that start with a dot: a
    writer's temporary files and their checksums); True if it did. A Delta log like that holds no commit."""
    fs, hadoop_path = _fs(spark, path)
    if not fs.exists(hadoop_path):
        return False
    files = fs.listFiles(hadoop_path, True)
    while files.hasNext():
        if not files.next().getPath().getName().startswith("."):
            return False
    return bool(fs.delete(hadoop_path, True))


def write_text(spark: SparkSession, path: str, text: str) -> None:
    """Write a small file (overwriting it)."""
    fs, hadoop_path = _fs(spark, path)
    stream = fs.create(hadoop_path, True)
    try:
        stream.write(bytearray(text.encode()))
    finally:
        stream.close()


def rename_path(spark: SparkSession, source: str, destination: str) -> None:
    """Rename a file or folder (atomic on a local disk and HDFS); raises if ``destination`` exists."""
    fs, src = _fs(spark, source)
    _, dst = _fs(spark, destination)
    if fs.exists(dst) or not fs.rename(src, dst):
        raise OSError(f"could not rename {source} to {destination}")


def read_text(spark: SparkSession, path: str) -> str:
    """Read a small file through Hadoop's FileSystem (``spark.read`` would skip names starting with ``_``).

    Raises :class:`ChecksumError` for a file that no longer matches its checksum file (one edited by hand keeps
    the old ``.crc`` beside it): which file, and how to go on.
    """
    from py4j.java_gateway import is_instance_of
    from py4j.protocol import Py4JJavaError

    fs, hadoop_path = _fs(spark, path)
    try:
        stream = fs.open(hadoop_path)
        try:
            return str(java_class(spark, "org.apache.commons.io.IOUtils").toString(stream, "UTF-8"))
        finally:
            stream.close()
    except Py4JJavaError as exc:
        gateway = spark.sparkContext._gateway
        if not any(is_instance_of(gateway, c, "org.apache.hadoop.fs.ChecksumException") for c in jvm_causes(exc)):
            raise
        parent, name = hadoop_path.getParent().toString(), hadoop_path.getName()
        raise ChecksumError(
            f"{path} does not match its checksum file {parent}/.{name}.crc: it was changed by hand or damaged; if "
            f"the change was meant, remove {parent}/.{name}.crc, else put the file back as it was"
        ) from None


def _read_lines(spark: SparkSession, path: str) -> list[str]:
    return read_text(spark, path).splitlines()


def batch_ids(spark: SparkSession, folder: str) -> list[int]:
    """The batch ids with a file in a checkpoint's ``offsets`` or ``commits`` folder, ascending."""
    fs, hadoop_path = _fs(spark, folder)
    if not fs.exists(hadoop_path):
        return []
    names = [status.getPath().getName() for status in fs.listStatus(hadoop_path)]
    return sorted(int(name) for name in names if name.isdigit())


def checkpoint_generation(spark: SparkSession, checkpoint: str) -> str:
    """The id Spark gave this checkpoint when it was created; a new checkpoint folder gets a new one."""
    metadata = json.loads(_read_lines(spark, f"{checkpoint.rstrip('/')}/metadata")[0])
    return str(metadata["id"])


def last_committed_offsets(spark: SparkSession, checkpoint: str) -> Offsets | None:
    """The end offsets of the last batch the checkpoint says finished, or None if none did."""
    committed = batch_ids(spark, f"{checkpoint.rstrip('/')}/commits")
    return batch_end_offsets(spark, checkpoint, committed[-1]) if committed else None


def batch_end_offsets(spark: SparkSession, checkpoint: str, batch_id: int) -> Offsets:
    """The Kafka end offsets of micro-batch ``batch_id``, from Spark's offset log (written before it runs)."""
    lines = _read_lines(spark, f"{checkpoint.rstrip('/')}/offsets/{batch_id}")
    # Line 0 is the log version, line 1 the batch metadata, then one line per source (we have one).
    source = json.loads(lines[2])
    return parse_offsets(source)


@dataclass(frozen=True)
class AppliedVersion:
    """What one Delta commit of a replica table says about itself."""

    version: int
    replica: str
    batch_id: int
    generation: str
    offsets: Offsets
    #: The id of each topic the offsets are of, where the replica knew it (``replica_lib.stream``): a topic deleted
    #: and created again under its name has another, and offsets that start over.
    topic_ids: Mapping[str, str] = field(default_factory=dict)
    #: What each table of the replica was ordered by (its ``sequence_by``; None: the log position), where the commit
    #: says: the rows keep the versions it gave them, whatever becomes of the checkpoint.
    sequence_by: Mapping[str, str | None] = field(default_factory=dict)
    #: The Delta id of the quarantine table the batch wrote beside the tables, where the commit says: the records
    #: it holds unresolved hold their keys' rows at their state before them.
    quarantine_id: str | None = None


def _parse(version: int, user_metadata: str | None) -> AppliedVersion | None:
    if not user_metadata:
        return None
    try:
        data: dict[str, Any] = json.loads(user_metadata)
        offsets = parse_offsets(data["offsets"])
        ids = {str(topic): str(topic_id) for topic, topic_id in dict(data.get("topic_ids") or {}).items()}
        sequences = {str(t): None if s is None else str(s) for t, s in dict(data.get("sequence_by") or {}).items()}
        quarantine = data.get("quarantine_id")
        return AppliedVersion(
            version,
            data["replica"],
            int(data["batch_id"]),
            data["generation"],
            offsets,
            ids,
            sequences,
            None if quarantine is None else str(quarantine),
        )
    except (ValueError, KeyError, TypeError):
        return None


def applied_offsets(spark: SparkSession, target: Target, version: int | None = None) -> AppliedVersion | None:
    """The Kafka offsets that a table version reflects (the latest version if None).

    That is the newest replica commit at or before ``version``: every record below these offsets has been
    applied to the table, and none at or above them.
    """
    from delta.tables import DeltaTable

    table = DeltaTable.forPath(spark, target.path) if target.path else DeltaTable.forName(spark, str(target.table))
    history = table.history().select("version", "userMetadata")
    if version is not None:
        history = history.where(F.col("version") <= version)
    for row in history.where(F.col("userMetadata").isNotNull()).orderBy(F.col("version").desc()).collect():
        parsed = _parse(int(row["version"]), row["userMetadata"])
        if parsed is not None:
            return parsed
    return None


def applied_versions(spark: SparkSession, target: Target) -> list[AppliedVersion]:
    """Every replica commit of a table, oldest first, each with the offsets it reflects (one read of the history)."""
    from delta.tables import DeltaTable

    table = DeltaTable.forPath(spark, target.path) if target.path else DeltaTable.forName(spark, str(target.table))
    rows = table.history().select("version", "userMetadata").where(F.col("userMetadata").isNotNull()).collect()
    parsed = (_parse(int(row["version"]), row["userMetadata"]) for row in rows)
    return sorted((p for p in parsed if p is not None), key=lambda p: p.version)


@dataclass(frozen=True)
class ReplicaCommit:
    """A replica's newest commit to a table: what it applied, and when it was committed (seconds since the epoch)."""

    applied: AppliedVersion
    committed_s: float


def newest_commit(spark: SparkSession, target: Target, replica: str) -> ReplicaCommit | None:
    """The newest commit that ``replica`` made to a table (its offsets in the metadata), or None.

    Other commits (a compaction, another writer) carry no replica metadata and are passed over.
    """
    return next(_replica_commits(spark, target, replica), None)


def last_writer(spark: SparkSession, target: Target) -> str | None:
    """The replica that made a table's newest replica commit (one with offsets in its metadata), or None."""
    commit = next(_replica_commits(spark, target, None), None)
    return None if commit is None else commit.applied.replica


def restored_since(spark: SparkSession, target: Target) -> tuple[int, str] | None:
    """A RESTORE of a table newer than its newest replica commit, as (its version, the version it restored), or None.

    Delta's RESTORE puts back an older version's files in a new commit, keeping the table's id; the history's newest
    replica commit then still names the offsets of the rows it replaced. Only the recent history is read.
    """
    for row in _recent_history(spark, target):
        if _parse(int(row["version"]), row["userMetadata"]) is not None:
            return None
        if row["operation"] == "RESTORE":
            parameters = row["operationParameters"] or {}
            return int(row["version"]), str(parameters.get("version") or parameters.get("timestamp"))
    return None


#: Recent histories read, by table and version: a replica's start asks each table's several times (who wrote it
#: last, whether it was restored, its last batch), each read of it a tenth of a second or more.
_HISTORIES: OrderedDict[tuple[str, int], list[Row]] = OrderedDict()  # least recently used first
_HISTORIES_KEPT = 64


def _recent_history(spark: SparkSession, target: Target) -> list[Row]:
    """A table's last :data:`_RECENT` commits, newest first (version, operation, operationParameters, userMetadata,
    committed_s), read once per version of the table."""
    from delta.tables import DeltaTable

    from replica_lib.target import latest_snapshot  # replica_lib.target imports this module

    snapshot = latest_snapshot(spark, target)
    version = None if snapshot is None else int(snapshot.version())
    # The table's id too: a table created again at the same place may reach the same version.
    key = (f"{target.describe()} {snapshot.metadata().id() if snapshot is not None else ''}", version or 0)
    if version is not None and key in _HISTORIES:
        _HISTORIES.move_to_end(key)
        return _HISTORIES[key]
    table = DeltaTable.forPath(spark, target.path) if target.path else DeltaTable.forName(spark, str(target.table))
    rows = _history_rows(table.history(_RECENT))
    if version is not None and rows and int(rows[0]["version"]) == version:
        _HISTORIES[key] = rows
        while len(_HISTORIES) > _HISTORIES_KEPT:
            _HISTORIES.popitem(last=False)
    return rows


def _history_rows(history: DataFrame) -> list[Row]:
    columns = ("version", "operation", "operationParameters", "userMetadata")
    committed_s = (F.unix_micros("timestamp") / 1e6).alias("committed_s")
    return history.select(*columns, committed_s).orderBy(F.col("version").desc()).collect()


def _replica_commits(spark: SparkSession, target: Target, replica: str | None) -> Iterator[ReplicaCommit]:
    """``replica``'s commits to a table (any replica's if None), newest first. The recent history is read first, as
    the commit a caller looks for is almost always among the last few; the whole history only if it is not."""
    from delta.tables import DeltaTable

    below: int | None = None  # the oldest version read so far: the whole history goes on from there
    for whole in (False, True):
        if whole:
            table = (
                DeltaTable.forPath(spark, target.path) if target.path else DeltaTable.forName(spark, str(target.table))
            )
            rows = _history_rows(table.history())
        else:
            rows = _recent_history(spark, target)
        for row in rows:
            if below is not None and int(row["version"]) >= below:
                continue
            parsed = _parse(int(row["version"]), row["userMetadata"])
            if parsed is not None and replica in (None, parsed.replica):
                yield ReplicaCommit(parsed, float(row["committed_s"]))
        if len(rows) < _RECENT:
            return  # that was the whole history
        below = int(rows[-1]["version"])


_RECENT = 100  # commits of history read before the whole history is

#: The checkpoint generation under which replays of quarantined records commit (their batch ids: the time they
#: started, in ms), between the batches of a replica's own generations.
REPLAY_GENERATION = "replay"
#: The generation of a swap's commits (``swap-<swap id>``, :mod:`replica_lib.swap`).
SWAP_GENERATION = "swap-"


def last_batch(spark: SparkSession, target: Target, replica: str, generation: str) -> int:
    """The last batch of ``replica``'s checkpoint ``generation`` committed to a table, from its history; -1 if none.

    Newest first: the first commit of the generation is its last batch (batches commit in order). A commit of
    another of the replica's generations (not a replay's) ends the search: generations follow one another, so the
    table holds nothing of this one after that commit, nor before it.
    """
    for commit in _replica_commits(spark, target, replica):
        if commit.applied.generation == generation:
            return commit.applied.batch_id
        if commit.applied.generation != REPLAY_GENERATION:
            return -1
    return -1
