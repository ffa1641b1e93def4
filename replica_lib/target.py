"""Delta targets: the replica tables, their tombstone tables and the quarantine table, with fixed schemas."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from replica_lib.config import (
    ReplicaConfig,
    TableConfig,
    Target,
    changes_location,
    check_table_schema,
    schema_json,
    tombstone_location,
)
from replica_lib.errors import ConfigError
from replica_lib.progress import remove_if_empty

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
        return T.StructType(list(self.replica_schema.fields) + list(CHANGE_EXTRA.fields))

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
    return [*targets, cfg.quarantine, *([cfg.metrics] if metrics and cfg.metrics is not None else [])]


def read_table(spark: SparkSession, target: Target, version: int | None = None) -> DataFrame:
    """The table's rows: its latest version, or exactly ``version`` (Delta time travel)."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    if target.path:
        return reader.load(target.path)
    assert target.table is not None
    return reader.table(target.table)


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
    from delta.tables import DeltaTable

    if not table_exists(spark, target):
        return None
    table = DeltaTable.forPath(spark, target.path) if target.path else DeltaTable.forName(spark, str(target.table))
    # The id is in the snapshot's metadata, which Delta reads from the log alone; DESCRIBE DETAIL would also count
    # the table's files, a Spark job (several seconds on a starting JVM) that a start-up check need not pay.
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    none = jvm.scala.Option.empty()
    return str(table._jdt.deltaLog().update(False, none, none).metadata().id())


def ensure_table(
    spark: SparkSession,
    target: Target,
    schema: T.StructType,
    description: str,
    deletion_vectors: bool | None = None,
) -> None:
    """Create the Delta table if it does not exist; an existing one must have exactly ``schema``'s columns.

    ``deletion_vectors``: a replica table's setting (``TableConfig.deletion_vectors``), which an existing table
    must match; None for append-only tables, which go without them (their reads are cheaper).
    """
    from delta.tables import DeltaTable

    if table_exists(spark, target):
        existing = read_table(spark, target).schema
        have = [(f.name, f.dataType.simpleString()) for f in existing.fields]
        want = [(f.name, f.dataType.simpleString()) for f in schema.fields]
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
    # A creation killed before its first commit leaves a log folder with no commit in it, which Delta takes for a
    # table that is not there (DELTA_TABLE_NOT_FOUND) on every later try: nothing was ever committed, so it goes.
    if target.path and remove_if_empty(spark, f"{target.path.rstrip('/')}/_delta_log"):
        logger.warning("%s: removed the empty log of a creation that never committed", target.describe())
    builder = DeltaTable.createIfNotExists(spark).addColumns(schema).comment(description)
    builder = builder.location(target.path) if target.path else builder.tableName(str(target.table))
    builder = builder.property(_DELETION_VECTORS, "true" if deletion_vectors else "false")
    builder.execute()
    logger.info("created Delta table %s", target.describe())


_DELETION_VECTORS = "delta.enableDeletionVectors"


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
    """Validate every table schema and create the replica, tombstone and quarantine tables that are missing."""
    schemas = {}
    for table in cfg.tables:
        schema = table_schema(table, cfg.source_file)
        ensure_table(
            spark,
            table.target,
            schema.replica_schema,
            f"replica {cfg.name}: table {table.name}",
            deletion_vectors=table.deletion_vectors,
        )
        ensure_table(
            spark,
            tombstone_target(table),
            schema.tombstone_schema,
            f"replica {cfg.name}: retained deletes of {table.name}",
        )
        if table.merge_on_read:
            ensure_table(
                spark,
                changes_target(table),
                schema.changes_schema,
                f"replica {cfg.name}: changes of {table.name} not yet folded into it",
            )
        schemas[table.name] = schema
    ensure_table(spark, cfg.quarantine, QUARANTINE_SCHEMA, f"replica {cfg.name}: records that could not be applied")
    return schemas
