"""Delta targets: the replica tables, their tombstone tables and the quarantine table, with fixed schemas."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from replica_lib.config import (
    STRICT,
    ReplicaConfig,
    TableConfig,
    Target,
    changes_location,
    check_table_schema,
    resolved_location,
    schema_json,
    tombstone_location,
)
from replica_lib.errors import ConfigError
from replica_lib.progress import remove_if_uncommitted
from replica_lib.session import java_class

logger = logging.getLogger(__name__)

#: Provenance of every replica row: the Kafka record that set it, its sequence and its event time.
PROVENANCE = T.StructType(
    [
        T.StructField("_src_topic", T.StringType()),
        T.StructField("_src_partition", T.IntegerType()),
        T.StructField("_src_offset", T.LongType()),
        T.StructField("_src_seq", T.LongType()),
        T.StructField("_src_event_ts", T.TimestampType()),
    ]
)
PROVENANCE_COLUMNS = tuple(field.name for field in PROVENANCE.fields)


def version_columns(keys: tuple[str, ...]) -> list[str]:
    """A row's or retained delete's key and version: ``keys + _src_partition, _src_offset, _src_seq``."""
    return [*keys, *PROVENANCE_COLUMNS[1:4]]


#: Extra columns of a tombstone row (besides keys and provenance).
TOMBSTONE_EXTRA = T.StructType(
    [
        T.StructField("_deleted_at", T.TimestampType()),
        T.StructField("_app_id", T.StringType()),
        T.StructField("_batch_id", T.LongType()),
    ]
)

#: Extra columns of a change log row (a merge-on-read table's pending change: the row as it would be applied).
CHANGE_EXTRA = T.StructType(
    [
        T.StructField("_op", T.StringType()),  # upsert or delete (a delete's other columns are null)
        T.StructField("_generation", T.StringType()),  # the checkpoint generation that appended it
        T.StructField("_batch_id", T.LongType()),  # its batch in that generation (what a fold retires by)
    ]
)

QUARANTINE_SCHEMA = T.StructType(
    [
        T.StructField("replica", T.StringType()),
        T.StructField("batch_id", T.LongType()),
        T.StructField("topic", T.StringType()),
        T.StructField("partition", T.IntegerType()),
        T.StructField("offset", T.LongType()),
        T.StructField("kafka_timestamp", T.TimestampType()),
        T.StructField("key", T.BinaryType()),
        T.StructField("value", T.BinaryType()),
        T.StructField("table", T.StringType()),
        T.StructField("reason", T.StringType()),
        T.StructField("quarantined_at", T.TimestampType()),
        # Last: a quarantine table written before it existed gains it at the next start.
        # The key (JSON of its typed columns) whose later records this record holds, or holds behind another:
        # set for the records of a table with on_poison = "hold_key" whose key could be read.
        T.StructField("held_key", T.StringType()),
    ]
)

#: A quarantined record replayed (applied after a fix) or dropped, by its coordinates: ``<quarantine>__resolved``.
RESOLVED_SCHEMA = T.StructType(
    [
        T.StructField("topic", T.StringType()),
        T.StructField("partition", T.IntegerType()),
        T.StructField("offset", T.LongType()),
        T.StructField("table", T.StringType()),
        T.StructField("action", T.StringType()),  # replayed or dropped
        T.StructField("note", T.StringType()),  # why (a drop's reason)
        T.StructField("resolved_at", T.TimestampType()),
    ]
)


@dataclass(frozen=True)
class TableSchema:
    """A table's validated columns: what the change data carries and what the replica table keeps."""

    table: TableConfig
    data: T.StructType  # as declared in the config
    kept: T.StructType  # after include/exclude (keys always kept)

    @property
    def key_schema(self) -> T.StructType:
        return T.StructType([self.data[k] for k in self.table.keys])

    @property
    def replica_schema(self) -> T.StructType:
        return T.StructType(list(self.kept.fields) + list(PROVENANCE.fields))

    @property
    def changes_schema(self) -> T.StructType:
        """A change log's columns: a delete's row holds its key alone, so only key columns keep a NOT NULL."""
        fields = [
            f if f.name in self.table.keys else T.StructField(f.name, f.dataType, True, f.metadata)
            for f in self.replica_schema.fields
        ]
        return T.StructType(fields + list(CHANGE_EXTRA.fields))

    @property
    def tombstone_schema(self) -> T.StructType:
        return T.StructType(list(self.key_schema.fields) + list(PROVENANCE.fields) + list(TOMBSTONE_EXTRA.fields))


def table_schema(table: TableConfig, source_file: str) -> TableSchema:
    """A table's columns, from its DDL schema checked against its keys and column lists (no JVM needed).

    Raises :class:`ConfigError`; :func:`replica_lib.config.parse_replica` has already run the same checks.
    """
    check_table_schema(table, source_file)
    parsed = T.StructType.fromJson(schema_json(table.schema))
    if table.include_columns:
        wanted = set(table.include_columns) | set(table.keys)
        kept = [f for f in parsed.fields if f.name in wanted]
    else:
        kept = [f for f in parsed.fields if f.name not in table.exclude_columns]
    return TableSchema(table=table, data=parsed, kept=T.StructType(kept))


def tombstone_target(table: TableConfig) -> Target:
    """Where a table's retained tombstones live: beside it, as ``<path>__tombstones`` or ``<name>__tombstones``."""
    return tombstone_location(table.target)


def changes_target(table: TableConfig) -> Target:
    """Where a merge-on-read table's change log lives: beside it, as ``<path>__changes`` or ``<name>__changes``."""
    return changes_location(table.target)


def applied_target(table: TableConfig) -> Target:
    """The Delta table whose commits record each batch the replica applied to ``table`` (with its offsets).

    Copy-on-write: the table itself. Merge-on-read: its change log, which every batch appends to; the table's own
    commits (folds) record the offsets of the last batch they folded.
    """
    return changes_target(table) if table.merge_on_read else table.target


def replica_targets(cfg: ReplicaConfig, metrics: bool = True) -> list[Target]:
    """Every Delta table of a replica: each table with its retained deletes (and change log), then the
    quarantine and (with ``metrics``) the metrics table."""
    targets = [t for table in cfg.tables for t in (table.target, tombstone_target(table))]
    targets += [changes_target(table) for table in cfg.tables if table.merge_on_read]
    targets += [cfg.quarantine, resolved_location(cfg.quarantine)]
    return [*targets, *([cfg.metrics] if metrics and cfg.metrics is not None else [])]


def read_table(spark: SparkSession, target: Target, version: int | None = None) -> DataFrame:
    """The table's rows: its latest version, or exactly ``version`` (Delta time travel)."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    if target.path:
        return reader.load(target.path)
    assert target.table is not None
    return reader.table(target.table)


def creator(spark: SparkSession, target: Target) -> str | None:
    """The replica that created a table, from the description it gave it (``replica <name>: ...``), or None."""
    row = delta_table(spark, target).detail().select("description").first()
    found = re.match(r"replica (\w+): ", (row[0] if row is not None else None) or "")
    return found.group(1) if found else None


def delta_table(spark: SparkSession, target: Target) -> Any:
    """The ``DeltaTable`` of a target, by path or by catalog name."""
    from delta.tables import DeltaTable

    if target.path:
        return DeltaTable.forPath(spark, target.path)
    return DeltaTable.forName(spark, str(target.table))


def table_exists(spark: SparkSession, target: Target) -> bool:
    from delta.tables import DeltaTable

    if target.path:
        return bool(DeltaTable.isDeltaTable(spark, target.path))
    assert target.table is not None
    return bool(spark.catalog.tableExists(target.table))


def table_id(spark: SparkSession, target: Target) -> str | None:
    """Delta's id of the table at ``target``, or None if there is none.

    The id is given when the table is created and kept by every commit (OPTIMIZE included): a table deleted and
    created again, or another table at the same place, has another id.
    """
    snapshot = latest_snapshot(spark, target)
    return None if snapshot is None else str(snapshot.metadata().id())


@dataclass(frozen=True)
class LogState:
    """A table's latest version and its data files, read from its log alone."""

    version: int
    files: int
    size_bytes: int


def log_state(spark: SparkSession, target: Target) -> LogState | None:
    """The table's latest version, its data files and their bytes; None if there is no table.

    Read from the checksum (``.crc``) Delta writes beside each commit, which costs no Spark job; DESCRIBE DETAIL
    counts them by reconstructing the table's state (three jobs, seconds on a starting JVM), so it serves only a
    commit without a checksum (a writer that does not write one).
    """
    snapshot = latest_snapshot(spark, target)
    if snapshot is None:
        return None
    version = int(snapshot.version())
    checksum = snapshot.checksumOpt()
    if checksum.isDefined():
        return LogState(version, int(checksum.get().numFiles()), int(checksum.get().tableSizeBytes()))
    detail = delta_table(spark, target).detail().select("numFiles", "sizeInBytes").first()
    files, size = (0, 0) if detail is None else (int(detail[0] or 0), int(detail[1] or 0))
    return LogState(version, files, size)


def file_count(spark: SparkSession, target: Target) -> int | None:
    """The table's data files at its latest version; None if there is no table (see :func:`log_state`)."""
    state = log_state(spark, target)
    return None if state is None else state.files


def size_bytes(spark: SparkSession, target: Target) -> int | None:
    """The size of the table's data files at its latest version; None if there is no table (see :func:`log_state`)."""
    state = log_state(spark, target)
    return None if state is None else state.size_bytes


def latest_version(spark: SparkSession, target: Target) -> int | None:
    """The table's latest version, from its log alone (no Spark job); None if there is no table."""
    snapshot = latest_snapshot(spark, target)
    return None if snapshot is None else int(snapshot.version())


def is_empty(spark: SparkSession, target: Target) -> bool:
    """Whether there is no table at ``target`` or it has no data files (a new replica's, one being rebuilt)."""
    return not file_count(spark, target)


def latest_snapshot(spark: SparkSession, target: Target) -> Any:
    """The table's latest Delta snapshot (a JVM object), read from its log alone; None if there is no table.

    A table at a path is asked through its ``DeltaLog``: ``DeltaTable.forPath`` would first resolve a DataFrame
    over the table, several times the cost of the log's update, and a merge-on-read read asks three tables.
    """
    log = _delta_log(spark, target)
    if log is None:
        return None
    none = java_class(spark, "scala.Option").empty()
    snapshot = log.update(False, none, none)
    return snapshot if snapshot.version() >= 0 else None


def partition_columns(spark: SparkSession, target: Target) -> tuple[str, ...]:
    """The table's partition columns, from its log (none if there is no table)."""
    snapshot = latest_snapshot(spark, target)
    if snapshot is None:
        return ()
    columns = snapshot.metadata().partitionColumns()
    return tuple(str(columns.apply(i)) for i in range(columns.size()))


def _delta_log(spark: SparkSession, target: Target) -> Any:
    """The table's ``DeltaLog`` (a JVM object); None for a table by name that does not exist."""
    if target.path:
        return java_class(spark, "org.apache.spark.sql.delta.DeltaLog").forTable(spark._jsparkSession, target.path)
    if not table_exists(spark, target):
        return None
    return delta_table(spark, target)._jdt.deltaLog()


def sql_type(data_type: T.DataType) -> str:
    """``data_type`` as SQL text, a struct's field names quoted (``simpleString`` leaves them bare: ``a-b``)."""
    if isinstance(data_type, T.ArrayType):
        return f"ARRAY<{sql_type(data_type.elementType)}>"
    if isinstance(data_type, T.MapType):
        return f"MAP<{sql_type(data_type.keyType)}, {sql_type(data_type.valueType)}>"
    if isinstance(data_type, T.StructType):
        return "STRUCT<" + ", ".join(f"`{f.name}`: {sql_type(f.dataType)}" for f in data_type) + ">"
    return data_type.simpleString()


def sql_string(text: str) -> str:
    """``text`` as a Spark SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def ensure_table(
    spark: SparkSession,
    target: Target,
    schema: T.StructType,
    description: str,
    deletion_vectors: bool | None = None,
    grows: bool = False,
    change_log: bool = False,
) -> None:
    """Create the Delta table if it does not exist; an existing one must have exactly ``schema``'s columns.

    ``grows``: an existing table whose columns are the first of ``schema``'s (written before the others existed)
    gains the others.

    ``deletion_vectors``: a replica table's setting (``TableConfig.deletion_vectors``), which an existing table
    must match; None for append-only tables, which go without them (their reads are cheaper).
    ``change_log``: a new table is a merge-on-read change log, partitioned by :data:`CHANGE_LOG_PARTITIONS` and
    checkpointed every :data:`CHANGE_LOG_CHECKPOINTS` commits.
    """
    from delta.tables import DeltaTable

    if table_exists(spark, target):
        existing = read_table(spark, target).schema
        have = [(f.name, f.dataType.simpleString()) for f in existing.fields]
        want = [(f.name, f.dataType.simpleString()) for f in schema.fields]
        if grows and have != want and have == want[: len(have)]:
            for f in schema.fields[len(have) :]:
                spark.sql(f"ALTER TABLE {target.describe()} ADD COLUMNS (`{f.name}` {sql_type(f.dataType)})")
            logger.info("%s: added columns %s", target.describe(), ", ".join(n for n, _ in want[len(have) :]))
            have = want
        if have != want:
            raise ConfigError(
                target.describe(),
                "schema",
                f"the existing table has columns {have}, the config declares {want}",
                "restore the config's schema, or rebuild the replica: new table locations and a new, empty "
                "replica.checkpoint folder (the old checkpoint would skip the log already applied)",
            )
        if deletion_vectors is not None:
            _check_deletion_vectors(spark, target, deletion_vectors)
        return
    # A creation killed before its first commit leaves a log folder with no commit in it (at most the hidden
    # temporary file of the commit it was writing), which Delta takes for a table that is not there
    # (DELTA_TABLE_NOT_FOUND) on every later try: nothing was ever committed, so it goes.
    if target.path and remove_if_uncommitted(spark, f"{target.path.rstrip('/')}/_delta_log"):
        logger.warning("%s: removed the log of a creation that never committed (it held no commit)", target.describe())
    builder = DeltaTable.createIfNotExists(spark).addColumns(schema).comment(description)
    builder = builder.location(target.path) if target.path else builder.tableName(str(target.table))
    builder = builder.property(_DELETION_VECTORS, "true" if deletion_vectors else "false")
    if change_log:
        builder = builder.partitionedBy(*CHANGE_LOG_PARTITIONS)
        builder = builder.property(_CHECKPOINT_INTERVAL, str(CHANGE_LOG_CHECKPOINTS))
    builder.execute()
    logger.info("created Delta table %s", target.describe())


_DELETION_VECTORS = "delta.enableDeletionVectors"
_CHECKPOINT_INTERVAL = "delta.checkpointInterval"
#: A change log's ``delta.checkpointInterval``. Delta writes a checkpoint inside the commit whose version is a
#: multiple of it, which for a change log is a batch's append: at Delta's default (10), every tenth batch took
#: a second or more longer. Each fold checkpoints the change log instead (``checkpoint``), beside the batches;
#: this interval only bounds the log's length when nothing folds.
CHANGE_LOG_CHECKPOINTS = 100
#: A change log's partition columns: each batch appends a partition of its own, so a fold retires whole
#: partitions, a DELETE that reads no row and that Delta does not refuse when a batch appended meanwhile (it
#: refuses a DELETE by other columns then, so the batches waited for each retirement: see ``layout.retire``).
CHANGE_LOG_PARTITIONS = ("_generation", "_batch_id")


def _check_deletion_vectors(spark: SparkSession, target: Target, wanted: bool) -> None:
    """Refuse a replica table whose deletion-vector setting is not the config's: readers were promised one."""
    properties = {row["key"]: row["value"] for row in spark.sql(f"SHOW TBLPROPERTIES {target.describe()}").collect()}
    has = properties.get(_DELETION_VECTORS) == "true"
    if has == wanted:
        return
    name = target.describe()
    fix = (
        f"ALTER TABLE {name} SET TBLPROPERTIES ('{_DELETION_VECTORS}' = 'true') in ./replica sql"
        if wanted
        else f"ALTER TABLE {name} DROP FEATURE deletionVectors in ./replica sql (see Delta's docs: it may need "
        "to be run again after the log retention) or rebuild it with jobs/rebuild.py"
    )
    raise ConfigError(
        name,
        "deletion_vectors",
        f"the existing table has deletion vectors {'off' if wanted else 'on'}, the config says {str(wanted).lower()}",
        f"set deletion_vectors = {str(has).lower()} in the table's section, or change the table: {fix}",
    )


def ensure_replica_tables(spark: SparkSession, cfg: ReplicaConfig) -> dict[str, TableSchema]:
    """Validate every table schema and create the replica, tombstone and quarantine tables that are missing.

    An existing replica table is brought to the config's schema where that is safe (:func:`plan_evolution`), and
    its columns beyond the config's (added from the data earlier) are kept: the schemas returned are the tables'.
    The other tables are checked or created side by side (:func:`_ensure_all`).
    """
    schemas = {}
    ensure: list[_Ensure] = []
    for table in cfg.tables:
        declared = table_schema(table, cfg.source_file)
        if table_exists(spark, table.target):
            _check_deletion_vectors(spark, table.target, table.deletion_vectors)
            schema = _evolve_to(spark, declared, cfg)
        else:
            schema = declared
            description = f"replica {cfg.name}: table {table.name}"
            ensure.append(_Ensure(table.target, schema.replica_schema, description, table.deletion_vectors))
        description = f"replica {cfg.name}: retained deletes of {table.name}"
        ensure.append(_Ensure(tombstone_target(table), schema.tombstone_schema, description))
        if table.merge_on_read:
            log = changes_target(table)
            if table_exists(spark, log):
                _align(spark, log, user_columns(read_table(spark, log).schema), schema, cfg.name, "the table's")
            else:
                description = f"replica {cfg.name}: changes of {table.name} not yet folded into it"
                ensure.append(_Ensure(log, schema.changes_schema, description, change_log=True))
        schemas[table.name] = schema
    description = f"replica {cfg.name}: records that could not be applied"
    ensure.append(_Ensure(cfg.quarantine, QUARANTINE_SCHEMA, description, grows=True))
    description = f"replica {cfg.name}: quarantined records replayed or dropped"
    ensure.append(_Ensure(resolved_location(cfg.quarantine), RESOLVED_SCHEMA, description))
    _ensure_all(spark, ensure)
    return schemas


@dataclass(frozen=True)
class _Ensure:
    """One :func:`ensure_table` call."""

    target: Target
    schema: T.StructType
    description: str
    deletion_vectors: bool | None = None
    grows: bool = False
    change_log: bool = False


#: Tables checked or created at once: each is a few small Spark jobs and a commit, mostly driver latency.
_ENSURE_THREADS = 4


def _ensure_all(spark: SparkSession, calls: Sequence[_Ensure]) -> None:
    """Run the :func:`ensure_table` calls side by side when every target is a path (each waits mostly on its
    table's log); tables by name go one by one, as a catalog serializes them anyway. The first failure is raised
    once all have ended."""

    def one(call: _Ensure) -> None:
        ensure_table(
            spark,
            call.target,
            call.schema,
            call.description,
            call.deletion_vectors,
            call.grows,
            call.change_log,
        )

    if len(calls) < 2 or any(call.target.path is None for call in calls):
        for call in calls:
            one(call)
        return
    with ThreadPoolExecutor(max_workers=_ENSURE_THREADS, thread_name_prefix="replica-ensure") as pool:
        futures = [pool.submit(one, call) for call in calls]
    for future in futures:
        future.result()


# ------------------------------------------------------------------------------------------ schema evolution
#: Columns a replica adds to a table's own: provenance, and a change log's bookkeeping.
_INTERNAL = frozenset(PROVENANCE_COLUMNS) | frozenset(f.name for f in CHANGE_EXTRA.fields)
_INTEGERS = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)


def user_columns(existing: T.StructType) -> T.StructType:
    """A replica table's (or change log's) own columns: what it holds of the rows, in the table's order."""
    return T.StructType([f for f in existing.fields if f.name not in _INTERNAL])


def widens(old: T.DataType, new: T.DataType) -> bool:
    """Whether every value of ``old`` is exactly a value of ``new`` and Delta widens one into the other in place
    (its type widening): a larger integer, FLOAT to DOUBLE, a DECIMAL with as many digits either side of the point."""
    if isinstance(old, _INTEGERS) and isinstance(new, _INTEGERS):
        return _INTEGERS.index(type(new)) > _INTEGERS.index(type(old))
    if isinstance(old, T.FloatType):
        return isinstance(new, T.DoubleType)
    if isinstance(old, T.DecimalType) and isinstance(new, T.DecimalType):
        more = (new.precision, new.scale) != (old.precision, old.scale)
        return more and new.scale >= old.scale and new.precision - new.scale >= old.precision - old.scale
    return False


@dataclass(frozen=True)
class Evolution:
    """How a table's columns change: columns added (nullable, after its last own column) and types widened."""

    added: tuple[T.StructField, ...] = ()
    widened: tuple[tuple[str, T.DataType], ...] = ()  # column, new type

    def __bool__(self) -> bool:
        return bool(self.added or self.widened)

    def describe(self) -> str:
        parts = [f"added {f.name} {f.dataType.simpleString().upper()}" for f in self.added]
        parts += [f"widened {name} to {t.simpleString().upper()}" for name, t in self.widened]
        return ", ".join(parts)


def plan_evolution(existing: T.StructType, declared: TableSchema, source_file: str) -> tuple[TableSchema, Evolution]:
    """The table's schema after bringing an existing table's own columns (``existing``) to the declared ones.

    Declared columns the table lacks are added and declared wider types widen the table's; the table's columns
    that the config does not declare, or has wider (added or widened from the data by ``schema_evolution =
    "add_columns"``), stay as the table has them, unless the table is ``strict``. Anything else (a narrower or
    other type, a key column's type, a declared column excluded now) cannot be done in place: :class:`ConfigError`
    says so.
    """
    table = declared.table
    have = {f.name: f for f in existing.fields}
    where = f"tables.{table.name}.schema"
    rebuild = "rebuild the replica (./replica rebuild … --swap) or restore the config's schema"
    widened = []
    kept_wider: dict[str, T.DataType] = {}  # widened from the data before: the table's type stays
    for f in declared.kept.fields:
        old = have.get(f.name)
        if old is None or old.dataType == f.dataType:
            continue
        if table.schema_evolution != STRICT and f.name not in table.keys and widens(f.dataType, old.dataType):
            kept_wider[f.name] = old.dataType
            continue
        if f.name in table.keys or not widens(old.dataType, f.dataType):
            raise ConfigError(
                source_file,
                where,
                f"column {f.name} is {old.dataType.simpleString().upper()} in {table.target.describe()} and "
                f"{f.dataType.simpleString().upper()} in the config, which is not a widening Delta can apply in "
                "place" + (" (a key column never changes type)" if f.name in table.keys else ""),
                rebuild,
            )
        widened.append((f.name, f.dataType))
    kept = {f.name for f in declared.kept.fields}
    extra = [f for f in existing.fields if f.name not in kept]
    excluded = [f.name for f in extra if f.name in declared.data.fieldNames()]
    if excluded or (extra and table.schema_evolution == STRICT):
        names = ", ".join(excluded or [f.name for f in extra])
        raise ConfigError(
            source_file,
            where,
            f"{table.target.describe()} has columns the config does not keep: {names}",
            "declare them in the schema (and take them out of include_columns/exclude_columns), or "
            + rebuild.replace("or restore the config's schema", "without them"),
        )
    added = tuple(f for f in declared.kept.fields if f.name not in have)
    data = T.StructType(list(declared.data.fields) + [f for f in extra if f.name not in declared.data.fieldNames()])
    order = [f.name for f in existing.fields] + [f.name for f in added]
    by_name = {f.name: f for f in data.fields}
    schema = replace(declared, data=data, kept=T.StructType([by_name[n] for n in order]))
    return with_new_fields(schema, (), tuple(kept_wider.items())), Evolution(added, tuple(widened))


def with_new_fields(
    schema: TableSchema, fields: Sequence[T.StructField], widened: Sequence[tuple[str, T.DataType]] = ()
) -> TableSchema:
    """``schema`` with columns added from the data (nullable, after the table's own columns) and types widened."""
    added = [T.StructField(f.name, f.dataType, True) for f in fields]
    wider = dict(widened)

    def typed(columns: Sequence[T.StructField]) -> list[T.StructField]:
        return [T.StructField(f.name, wider.get(f.name, f.dataType), f.nullable, f.metadata) for f in columns]

    return replace(
        schema,
        data=T.StructType([*typed(schema.data.fields), *added]),
        kept=T.StructType([*typed(schema.kept.fields), *added]),
    )


def evolve_table(spark: SparkSession, schema: TableSchema, evolution: Evolution, replica: str, why: str) -> None:
    """Apply ``evolution`` to a replica table (and its change log), each step once: a re-run after a crash finds
    what is done already and does the rest. Logs each table version it creates."""
    table = schema.table
    targets = [table.target, *([changes_target(table)] if table.merge_on_read else [])]
    for target in targets:
        if table_exists(spark, target):
            _align(spark, target, user_columns(read_table(spark, target).schema), schema, replica, why)


def _align(
    spark: SparkSession, target: Target, existing: T.StructType, schema: TableSchema, replica: str, why: str
) -> None:
    """Add the columns of ``schema.kept`` that ``target`` lacks and widen the ones it has narrower."""
    have = {f.name: f for f in existing.fields}
    name = target.describe()
    last = existing.fields[-1].name if existing.fields else None
    for f in schema.kept.fields:
        old = have.get(f.name)
        if old is None:
            position = f" AFTER `{last}`" if last else " FIRST"
            spark.sql(f"ALTER TABLE {name} ADD COLUMNS (`{f.name}` {sql_type(f.dataType)}{position})")
            _log_evolution(spark, target, replica, f"added column {f.name} {f.dataType.simpleString().upper()}", why)
        elif old.dataType != f.dataType:
            spark.sql(f"ALTER TABLE {name} SET TBLPROPERTIES ('{_TYPE_WIDENING}' = 'true')")
            spark.sql(f"ALTER TABLE {name} ALTER COLUMN `{f.name}` TYPE {sql_type(f.dataType)}")
            what = f"widened column {f.name} to {f.dataType.simpleString().upper()}"
            _log_evolution(spark, target, replica, what, why)
        last = f.name


_TYPE_WIDENING = "delta.enableTypeWidening"


def _log_evolution(spark: SparkSession, target: Target, replica: str, what: str, why: str) -> None:
    table = delta_table(spark, target)
    version = table.history(1).select("version").first()
    logger.warning(
        "replica %s: %s of %s (%s): table version %s",
        replica,
        what,
        target.describe(),
        why,
        None if version is None else version[0],
    )


def _evolve_to(spark: SparkSession, declared: TableSchema, cfg: ReplicaConfig) -> TableSchema:
    """An existing replica table brought to the config's schema (see :func:`plan_evolution`)."""
    existing = user_columns(read_table(spark, declared.table.target).schema)
    schema, evolution = plan_evolution(existing, declared, cfg.source_file)
    if evolution:
        evolve_table(spark, schema, evolution, cfg.name, f"the config declares it: {evolution.describe()}")
    if evolution.added and not is_empty(spark, declared.table.target):
        logger.warning(
            "replica %s: table %s gains column(s) %s from the config, which its rows so far read as NULL: the "
            "records applied before were read without them, and any value they held for them is not in the table; "
            "to fill them from the log, rebuild it: ./replica rebuild %s --into <folder> --swap",
            cfg.name,
            declared.table.name,
            ", ".join(f.name for f in evolution.added),
            cfg.source_file,
        )
    return schema


def current_schema(spark: SparkSession, table: TableConfig) -> TableSchema:
    """A table's schema as its Delta table has it now: the config's, and the columns added since from the data."""
    declared = table_schema(table, "")
    if not table_exists(spark, table.target):
        return declared
    existing = user_columns(read_table(spark, table.target).schema)
    by_name = {f.name: f for f in existing.fields}
    extra = [f for f in existing.fields if f.name not in declared.data.fieldNames()]
    data = T.StructType([by_name.get(f.name, f) for f in declared.data.fields] + extra)
    return replace(declared, data=data, kept=existing)
