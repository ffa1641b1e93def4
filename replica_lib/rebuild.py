"""Rebuild a replica from the log into tables of its own (a shadow beside the live ones, or a point in time).

The bulk path: one batch read of the replica's topics from their earliest offsets up to a fixed end, applied by
the streaming path's own :class:`~replica_lib.batch.BatchHandler` (same decoding, quarantine, ordering and
idempotent writes) as one batch, so every key gets one winner over the whole range and every table one write.
The end offsets are recorded in each commit as the streaming path records them; a replica started on the rebuilt
tables with a new, empty checkpoint resumes from there (:func:`replica_lib.recovery.starting_offsets`).

The plan (end offsets, generation) is written to the rebuild's folder before anything is read, so a rebuild
killed at any point and run again finishes the same plan: writes that committed are skipped by their
``txnAppId``/``txnVersion``, the rest are made.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pyspark.sql import DataFrame, SparkSession

from replica_lib.batch import BatchHandler, BatchHooks, BatchStats
from replica_lib.config import ReplicaConfig, Target
from replica_lib.errors import ConfigError, RebuildError, TopicError, TopicReplacedError
from replica_lib.layout import fold
from replica_lib.meter import metered
from replica_lib.metrics import late_counts
from replica_lib.progress import Offsets, offsets_json, parse_offsets, path_exists, read_text, write_text
from replica_lib.recovery import lock_checkpoint
from replica_lib.session import replica_session
from replica_lib.source import check_reachable
from replica_lib.target import ensure_replica_tables
from replica_lib.topics import TopicAdmin

logger = logging.getLogger(__name__)

PLAN_FILE = "_rebuild.json"
#: Written into a rebuild's folder once its tables were swapped in (:mod:`replica_lib.swap`): they are live now.
SWAPPED_FILE = "_swapped.json"


@dataclass(frozen=True)
class Plan:
    """What a rebuild applies: every record below ``ends`` (topic -> partition -> exclusive end offset).

    ``topic_ids``: the Kafka id of each topic it read (none where the Python client cannot connect), which its
    commits record and which a later run and the swap check: offsets of a topic created again name other records.
    """

    ends: Offsets
    generation: str
    topic_ids: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        data: dict[str, object] = {"ends": offsets_json(self.ends), "generation": self.generation}
        if self.topic_ids:
            data["topic_ids"] = dict(sorted(self.topic_ids.items()))
        return json.dumps(data, sort_keys=True)

    @staticmethod
    def of(ends: Offsets, topic_ids: Mapping[str, str] | None = None) -> Plan:
        canonical = json.dumps({t: sorted(parts.items()) for t, parts in sorted(ends.items())})
        return Plan(ends, "rebuild-" + hashlib.sha256(canonical.encode()).hexdigest()[:16], dict(topic_ids or {}))


def rebuild_config(cfg: ReplicaConfig, root: str) -> ReplicaConfig:
    """``cfg`` with its tables, quarantine and plan under ``root``: ``root/<table>``, ``root/_quarantine``."""
    base = root.rstrip("/")
    if any(
        _inside(t.target.path or "", base) or _inside(base, t.target.path or "") for t in cfg.tables if t.target.path
    ):
        raise ConfigError(
            cfg.source_file,
            "--into",
            f"{root} overlaps a table of replica {cfg.name}",
            "rebuild into a folder of its own, apart from the live tables",
        )
    tables = tuple(replace(t, target=Target(path=f"{base}/{t.name}")) for t in cfg.tables)
    return replace(
        cfg,
        tables=tables,
        quarantine=Target(path=f"{base}/_quarantine"),
        checkpoint=f"{base}/_rebuild",
        metrics=None,
    )


def _inside(path: str, folder: str) -> bool:
    return bool(path) and (path == folder or path.startswith(folder.rstrip("/") + "/"))


def preflight(cfg: ReplicaConfig, ends: Offsets, late: Mapping[str, int] | None = None) -> list[str]:
    """Before anything is read: can the log still reproduce the state up to ``ends``? Returns warnings.

    Raises :class:`RebuildError` when records the rebuild needs are gone: a partition that no longer starts at
    offset 0 lost records (retention under ``cleanup.policy=delete`` or ``compact,delete``, or a records deletion;
    compaction alone never moves a partition's start). On a compacted log, deletes
    older than ``delete.retention.ms`` may have been removed together with the key's earlier records: the
    rebuilt table then lacks the key, as it should. ``late`` (late changes the live replica counted, by table) names
    the compacted topics where compaction may have kept a late change in place of the change that wins by seq.
    """
    client = cfg.kafka.client_config()
    if client.settings is None:
        return [f"not checking what the log still holds: {client.reason}"]
    admin = TopicAdmin(client.settings)
    warnings = []
    for topic, topic_ends in sorted(ends.items()):
        described = admin.describe(topic)
        if described is None:
            raise RebuildError(f"topic {topic!r} of replica {cfg.name} does not exist")
        configs = described[2]
        policy = set(configs.get("cleanup.policy", "delete").replace(" ", "").split(","))
        starts = admin.earliest_offsets(topic)
        trimmed = {p: o for p, o in sorted(starts.items()) if o > 0 and topic_ends.get(p, 0) > 0}
        if trimmed:
            where = ", ".join(f"partition {p} starts at {o}" for p, o in trimmed.items())
            raise RebuildError(
                f"topic {topic} (cleanup.policy={','.join(sorted(policy))}) no longer holds its first records "
                f"({where}): they were deleted by retention or a records deletion, so a rebuild cannot reproduce "
                "the replica's state; rebuild from a copy that holds them (the live replica's tables), or use "
                "cleanup.policy=compact with retention.ms=-1 for topics that must stay rebuildable"
            )
        if "compact" in policy:
            retention = int(configs.get("delete.retention.ms", "86400000"))
            warnings.append(
                f"topic {topic} is compacted: deletes older than delete.retention.ms ({retention} ms) may have been "
                "removed with their key's earlier records (the rebuilt table lacks those keys, as it should); a "
                "change written with a lower seq after a higher one may be the one compaction kept"
            )
            warnings.extend(_late_warning(cfg, topic, late or {}))
    return warnings


def _late_warning(cfg: ReplicaConfig, topic: str, late: Mapping[str, int]) -> list[str]:
    seen = {t.name: late[t.name] for t in cfg.tables if t.topic == topic and late.get(t.name)}
    if not seen:
        return []
    counted = ", ".join(f"{n} on table {name}" for name, n in sorted(seen.items()))
    return [
        f"topic {topic} has had late changes: replica {cfg.name} counted {counted}; where Kafka's cleaner kept such a "
        "change in place of the one with the higher seq, the rebuilt table differs from the live one: add --verify "
        "to compare them"
    ]


def log_ends(cfg: ReplicaConfig) -> Offsets:
    """The end of each of the replica's topics now, as a ``read_committed`` reader sees it."""
    client = cfg.kafka.client_config()
    if client.settings is None:
        raise RebuildError(f"replica {cfg.name}: cannot list the log's end offsets: {client.reason}; give --until")
    admin = TopicAdmin(client.settings)
    return {topic: admin.latest_offsets(topic) for topic in cfg.topics}


def plan(
    spark: SparkSession, shadow: ReplicaConfig, until: Offsets | None, late: Mapping[str, int] | None = None
) -> Plan:
    """The rebuild's plan: the one recorded by an earlier run into the same folder, else a new one (recorded).

    ``late``: the live replica's late changes by table, for the pre-flight.
    """
    previous = recorded_plan(spark, shadow)
    ids = topic_ids_now(shadow)
    if previous is not None and path_exists(spark, f"{shadow.checkpoint}/{SWAPPED_FILE}"):
        folder = _folder(shadow)
        raise RebuildError(
            f"{folder} holds a rebuild of replica {shadow.name} that was swapped in already: its tables are the "
            f"live ones' past; rebuild into a new folder (or remove {folder} first)"
        )
    if previous is not None:
        check_rebuilt_topics(shadow, previous, ids)
        if until is not None and until != previous.ends:
            raise RebuildError(
                f"{shadow.checkpoint} holds a rebuild up to {_offsets_json(previous.ends)}, not the one asked; "
                "rebuild into another folder, or remove this one first"
            )
        logger.info("rebuild %s: going on with the recorded plan up to %s", shadow.name, _offsets_json(previous.ends))
        return previous
    new = Plan.of(until if until is not None else log_ends(shadow), ids)
    missing = sorted(set(shadow.topics) - set(new.ends))
    if missing:
        raise RebuildError(f"no end offsets given for topic(s) {', '.join(missing)} of replica {shadow.name}")
    for warning in preflight(shadow, new.ends, late):
        logger.warning("rebuild %s: %s", shadow.name, warning)
    write_text(spark, f"{shadow.checkpoint}/{PLAN_FILE}", new.to_json())
    return new


def recorded_plan(spark: SparkSession, shadow: ReplicaConfig) -> Plan | None:
    """The plan an earlier run recorded in the rebuild's folder, or None."""
    path = f"{shadow.checkpoint}/{PLAN_FILE}"
    if not path_exists(spark, path):
        return None
    recorded = json.loads(read_text(spark, path))
    ids = {str(topic): str(topic_id) for topic, topic_id in dict(recorded.get("topic_ids") or {}).items()}
    return Plan(parse_offsets(recorded["ends"]), str(recorded["generation"]), ids)


def topic_ids_now(cfg: ReplicaConfig) -> dict[str, str]:
    """The Kafka id of each of the replica's topics now; none where the Python client cannot connect (a JKS trust
    store, a Kerberos login) or the broker does not answer, as the replica's own start does without them."""
    client = cfg.kafka.client_config()
    if client.settings is None:
        return {}
    try:
        return TopicAdmin(client.settings).topic_ids(list(cfg.topics))
    except TopicError as exc:
        logger.warning("replica %s: could not read the topics' ids (%s), which are not checked", cfg.name, exc)
        return {}


def _folder(shadow: ReplicaConfig) -> str:
    """The folder a rebuild was made in (its plan is in ``<folder>/_rebuild``, :func:`rebuild_config`)."""
    return shadow.checkpoint.rsplit("/", 1)[0]


def check_rebuilt_topics(shadow: ReplicaConfig, rebuilt: Plan, ids: Mapping[str, str]) -> None:
    """Refuse a rebuild whose topics were deleted and created again since it read them: its tables hold the old
    topic's records, and the offsets it would go on from name other records now."""
    for topic, then in sorted(rebuilt.topic_ids.items()):
        now = ids.get(topic)
        if now is not None and now != then:
            folder = _folder(shadow)
            raise TopicReplacedError(
                f"rebuild of replica {shadow.name} in {folder}: topic {topic} is not the topic it read (its id was "
                f"{then}, it is {now} now): it was deleted and created again, so the rebuilt tables hold the old "
                f"topic's records; rebuild into a new folder (or remove {folder} first)"
            )


#: About how many records one task of a rebuild's read takes: the read is split into tasks of about this size, so
#: that the progress meter can count records by finished tasks (and a large partition is read in parallel).
RECORDS_PER_TASK = 100_000


def records_to_read(cfg: ReplicaConfig, ends: Offsets, starts: Offsets | None = None) -> int:
    """How many offsets lie below ``ends`` from ``starts`` or, where later, from where each partition starts now."""
    client = cfg.kafka.client_config()
    earliest: Offsets = {}
    if client.settings is not None:
        admin = TopicAdmin(client.settings)
        earliest = {topic: admin.earliest_offsets(topic) for topic in ends}
    starts = starts or {}
    return sum(
        max(0, end - max(earliest.get(t, {}).get(p, 0), starts.get(t, {}).get(p, 0)))
        for t, parts in ends.items()
        for p, end in parts.items()
    )


def read_range(
    spark: SparkSession, cfg: ReplicaConfig, ends: Offsets, records: int = 0, starts: Offsets | None = None
) -> DataFrame:
    """Every committed record of the replica's topics from ``starts`` (default: the log's start) up to ``ends``
    (Spark's batch read), in tasks of about :data:`RECORDS_PER_TASK` of the ``records`` expected."""
    options = cfg.kafka.spark_options()
    partitions = sum(len(parts) for parts in ends.values())
    if records > RECORDS_PER_TASK * partitions:
        options["minPartitions"] = str(-(-records // RECORDS_PER_TASK))
    options.update(
        {
            "subscribe": ",".join(cfg.topics),
            "startingOffsets": "earliest" if starts is None else _offsets_json(starts),
            "endingOffsets": _offsets_json(ends),
            "failOnDataLoss": "true",
            "kafka.isolation.level": "read_committed",
            "includeHeaders": "false",
        }
    )
    return spark.read.format("kafka").options(**options).load()


def _offsets_json(offsets: Offsets) -> str:
    return json.dumps(offsets_json(offsets))


def rebuild_session(spark: SparkSession) -> SparkSession:
    """A session of its own with the streaming batch's settings (the caller's confs stay as they are)."""
    return replica_session(spark)


def apply_range(
    session: SparkSession,
    shadow: ReplicaConfig,
    the_plan: Plan,
    batch_id: int,
    ends: Offsets,
    starts: Offsets | None = None,
    hooks: BatchHooks | None = None,
) -> BatchStats:
    """Apply the records from ``starts`` (the log's start) to ``ends`` to the rebuilt tables as one batch, then
    fold merge-on-read tables, so each holds its state itself, as a reader expects."""
    schemas = ensure_replica_tables(session, shadow)
    # The live replica's consumer group is its own; the commits record the topics the plan read, as the live ones do.
    handler = BatchHandler(shadow, schemas, hooks, monitored=False, topic_ids=the_plan.topic_ids)
    try:
        total = records_to_read(shadow, ends, starts)
        with metered(session, f"rebuild {shadow.name}", total):
            frame = read_range(session, shadow, ends, total, starts)
            stats = handler.apply(frame, batch_id, ends, the_plan.generation)
        for schema in schemas.values():
            if schema.table.merge_on_read:
                logger.info("rebuild %s: %s", shadow.name, fold(session, shadow.name, schema).line(schema.table.name))
        return stats
    finally:
        handler.close()


def rebuild(
    spark: SparkSession,
    cfg: ReplicaConfig,
    root: str,
    until: Offsets | None = None,
    hooks: BatchHooks | None = None,
) -> BatchStats:
    """Rebuild replica ``cfg`` into tables under ``root``, from the log's start up to ``until`` (default: the
    log's end now). Safe to run again after a crash; one rebuild per folder at a time."""
    shadow = rebuild_config(cfg, root)
    lock_checkpoint(shadow)
    check_reachable(shadow)
    session = rebuild_session(spark)
    the_plan = plan(session, shadow, until, late_counts(session, cfg))
    logger.info(
        "rebuild %s into %s: the log up to %s",
        cfg.name,
        root,
        ", ".join(f"{t}:" + ",".join(f"{p}={o}" for p, o in sorted(e.items())) for t, e in the_plan.ends.items()),
    )
    return apply_range(session, shadow, the_plan, 0, the_plan.ends, hooks=hooks)
