"""Raw Kafka records -> typed change rows. Every record that breaks the contract gets a reason instead.

Two stages, both pure ``DataFrame -> DataFrame``:

1. :func:`envelopes` reads each record's envelope (native or Debezium) and routes it to a table;
2. :func:`table_changes` types one table's key and row with the table's schema.

Any failure sets ``_error`` (a sentence saying what is wrong); :func:`valid` and :func:`rejected` split on it.
Columns of an envelope row: ``_topic, _partition, _offset, _kafka_ts, _key, _value`` (the raw record, kept for
quarantine; :func:`table_changes` keeps ``_key`` and ``_value`` on rejected changes only), ``_table, _op, _seq,
_event_ts, _tombstone, _key_json, _data_json, _error``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from replica_lib.config import ReplicaConfig, TableConfig
from replica_lib.target import TableSchema

_PERMISSIVE = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt"}
NATIVE_ENVELOPE = "op STRING, seq LONG, ts_ms LONG, table STRING, data STRING, _corrupt STRING"
DEBEZIUM_OUTER = "schema STRING, payload STRING, op STRING, _corrupt STRING"
DEBEZIUM_PAYLOAD = "before STRING, after STRING, op STRING, ts_ms LONG, source STRING, _corrupt STRING"
_DEBEZIUM_UPSERT_OPS = ("c", "r", "u")

ENVELOPE_COLUMNS = (
    "_topic",
    "_partition",
    "_offset",
    "_kafka_ts",
    "_key",
    "_value",
    "_table",
    "_op",
    "_seq",
    "_event_ts",
    "_tombstone",
    "_key_json",
    "_data_json",
    "_error",
)
CHANGE_COLUMNS = ("_op", "_seq", "_tombstone", "_topic", "_partition", "_offset", "_event_ts")


def _no_error() -> Column:
    return F.lit(None).cast("string")


def _raw(raw_df: DataFrame) -> DataFrame:
    return raw_df.select(
        F.col("topic").alias("_topic"),
        F.col("partition").alias("_partition"),
        F.col("offset").alias("_offset"),
        F.col("timestamp").alias("_kafka_ts"),
        F.col("key").alias("_key"),
        F.col("value").alias("_value"),
    )


def _suspect(parsed: Column, *fields: str) -> Column:
    """Whether a permissive parse may have met something other than a JSON object: the result is null or
    corrupt, or all of ``fields`` are null (as they are for any non-object). Only such records are parsed again."""
    absent = reduce(lambda a, b: a & b, [parsed[f].isNull() for f in fields])
    return parsed.isNull() | parsed["_corrupt"].isNotNull() | absent


def _first_error(*checks: tuple[Column, Column | str]) -> Column:
    """The message of the first check whose condition holds, else null."""
    expr = None
    for condition, message in checks:
        text = F.lit(message) if isinstance(message, str) else message
        expr = F.when(condition, text) if expr is None else expr.when(condition, text)
    assert expr is not None
    return expr.otherwise(_no_error())


def _route(tables: Sequence[TableConfig], named: Column) -> tuple[Column, Column]:
    """(table name, routing error) for a record whose envelope names ``named`` (may be null)."""
    names = [t.name for t in tables]
    default = F.lit(names[0]) if len(names) == 1 else F.lit(None).cast("string")
    table = F.when(named.isNull(), default).when(named.isin(names), named).otherwise(F.lit(None).cast("string"))
    error = F.when(
        named.isNotNull() & ~named.isin(names),
        F.concat(F.lit("unknown table '"), named, F.lit(f"' (this topic carries: {', '.join(names)})")),
    ).when(
        named.isNull() & F.lit(len(names) > 1),
        F.lit(f"no table field on a topic that carries several tables ({', '.join(names)})"),
    )
    return table, error


def typed_data_column(table: str) -> str:
    """The envelope column that holds a table's rows already typed (see :func:`native_envelopes`)."""
    return f"_typed_data:{table}"


def native_envelopes(raw_df: DataFrame, tables: Sequence[TableConfig], data: T.StructType | None = None) -> DataFrame:
    """Envelopes of the native format (docs/design.md §3).

    ``data``: the schema of the rows of a topic that carries one table. The value is then parsed once with the row
    typed inside it, into the column :func:`typed_data_column`; only a record that this parse does not take cleanly
    is parsed again as before (envelope first, its ``data`` as text for :func:`table_changes`), so that every
    rejected record gets the same reason either way.
    """
    text = F.col("_value").cast("string")
    parsed_df = _raw(raw_df)
    if data is not None:
        parsed_df = parsed_df.withColumn("_typed", F.from_json(text, _typed_envelope(data), _PERMISSIVE))
        typed = F.col("_typed")
        clean: Column = typed.isNotNull() & typed["_corrupt"].isNull() & typed["op"].isNotNull()
        fields = [typed[f].alias(f) for f in ("op", "seq", "ts_ms", "table")]
        untyped = F.from_json(text, NATIVE_ENVELOPE, _PERMISSIVE)  # evaluated only where ``clean`` is false
        # `data` is only tested for presence on a clean record (its typed form is in the typed column).
        present = F.when(typed["data"].isNotNull(), F.lit("")).cast("string").alias("data")
        none = F.lit(None).cast("string").alias("_corrupt")
        parsed_df = parsed_df.withColumn("_env", F.when(clean, F.struct(*fields, present, none)).otherwise(untyped))
    else:
        clean = F.lit(False)
        parsed_df = parsed_df.withColumn("_env", F.from_json(text, NATIVE_ENVELOPE, _PERMISSIVE))
    env = F.col("_env")
    is_tombstone = F.col("_value").isNull()
    op = env["op"]
    table, route_error = _route(tables, env["table"])
    error = _first_error(
        (F.col("_key").isNull(), "missing key: the Kafka record key is null"),
        (is_tombstone, _no_error()),
        # A second parse of the value, only for records whose envelope did not parse cleanly.
        (_suspect(env, "op") & F.json_object_keys(text).isNull(), "value is not a JSON object"),
        (
            env["_corrupt"].isNotNull(),
            "envelope has a field of the wrong type (op and table are strings, seq and ts_ms integers)",
        ),
        (op.isNull(), "missing op"),
        (
            ~op.isin("upsert", "delete"),
            F.concat(F.lit("unknown op '"), op, F.lit("' (expected upsert or delete)")),
        ),
        (route_error.isNotNull(), route_error),
        ((op == "upsert") & env["data"].isNull(), "upsert without data"),
    )
    typed_columns = (
        [] if data is None else [F.when(clean, F.col("_typed")["data"]).alias(typed_data_column(tables[0].name))]
    )
    return parsed_df.select(
        *_raw_columns(),
        F.when(is_tombstone, F.lit(tables[0].name) if len(tables) == 1 else F.lit(None).cast("string"))
        .otherwise(table)
        .alias("_table"),
        F.when(is_tombstone, F.lit("delete")).otherwise(op).alias("_op"),
        F.when(is_tombstone, F.lit(None).cast("long")).otherwise(env["seq"]).alias("_seq"),
        F.timestamp_millis(env["ts_ms"]).alias("_event_ts"),
        is_tombstone.alias("_tombstone"),
        F.col("_key").cast("string").alias("_key_json"),
        F.when(~clean, env["data"]).alias("_data_json"),
        F.when(
            is_tombstone & F.lit(len(tables) > 1),
            F.lit(
                "a tombstone on a topic that carries several tables cannot name its table; "
                "send op=delete with a table field instead"
            ),
        )
        .otherwise(error)
        .alias("_error"),
        *typed_columns,
    )


def _typed_envelope(data: T.StructType) -> T.StructType:
    envelope = T.DataType.fromDDL(NATIVE_ENVELOPE)
    assert isinstance(envelope, T.StructType)
    return T.StructType([f if f.name != "data" else T.StructField("data", data) for f in envelope.fields])


def debezium_envelopes(raw_df: DataFrame, table: TableConfig, data_columns: Sequence[str]) -> DataFrame:
    """Envelopes of Debezium's JSON format, with or without the ``schema``/``payload`` wrapper."""
    text = F.col("_value").cast("string")
    key_text = F.col("_key").cast("string")
    outer = F.col("_outer")
    wrapped = outer["payload"].isNotNull() & outer["op"].isNull()
    staged_df = (
        _raw(raw_df)
        .withColumn("_outer", F.from_json(text, DEBEZIUM_OUTER, _PERMISSIVE))
        .withColumn("_payload_text", F.when(wrapped, outer["payload"]).otherwise(text))
        .withColumn("_payload", F.from_json(F.col("_payload_text"), DEBEZIUM_PAYLOAD, _PERMISSIVE))
        .withColumn("_key_outer", F.from_json(key_text, "schema STRING, payload STRING"))
    )
    payload_text, payload, key_outer = F.col("_payload_text"), F.col("_payload"), F.col("_key_outer")
    key_json = F.when(
        key_outer["schema"].isNotNull() & key_outer["payload"].isNotNull(), key_outer["payload"]
    ).otherwise(key_text)
    is_tombstone = F.col("_value").isNull()
    dbz_op = payload["op"]
    is_upsert = dbz_op.isin(*_DEBEZIUM_UPSERT_OPS)
    source_ts = F.get_json_object(payload["source"], "$.ts_ms").cast("long")
    if table.sequence_by and table.sequence_by not in data_columns:
        seq: Column = F.get_json_object(payload_text, f"$.{table.sequence_by}").cast("long")
    else:
        seq = F.lit(None).cast("long")
    error = _first_error(
        (F.col("_key").isNull(), "missing key: the Kafka record key is null"),
        (is_tombstone, _no_error()),
        (_suspect(outer, "payload", "op") & F.json_object_keys(text).isNull(), "value is not a JSON object"),
        (payload["_corrupt"].isNotNull(), "Debezium payload has a field of the wrong type"),
        (dbz_op.isNull(), "missing op in the Debezium payload"),
        (
            ~dbz_op.isin(*_DEBEZIUM_UPSERT_OPS, "d"),
            F.concat(F.lit("unsupported Debezium op '"), dbz_op, F.lit("' (expected c, r, u or d)")),
        ),
        (is_upsert & payload["after"].isNull(), "Debezium change without 'after'"),
    )
    return staged_df.select(
        *_raw_columns(),
        F.lit(table.name).alias("_table"),
        F.when(is_tombstone | (dbz_op == "d"), F.lit("delete")).otherwise(F.lit("upsert")).alias("_op"),
        F.when(is_tombstone, F.lit(None).cast("long")).otherwise(seq).alias("_seq"),
        F.timestamp_millis(F.coalesce(source_ts, payload["ts_ms"])).alias("_event_ts"),
        is_tombstone.alias("_tombstone"),
        key_json.alias("_key_json"),
        # A delete's row image is `before`: only its sequence column is used (see table_changes).
        F.when(is_upsert, payload["after"]).when(dbz_op == "d", payload["before"]).alias("_data_json"),
        error.alias("_error"),
    )


def _raw_columns() -> list[Column]:
    return [F.col(c) for c in ("_topic", "_partition", "_offset", "_kafka_ts", "_key", "_value")]


def envelopes(raw_df: DataFrame, cfg: ReplicaConfig, schemas: dict[str, TableSchema]) -> DataFrame:
    """Every record of the batch as an envelope row, routed to its table (or given an ``_error``)."""
    parts = []
    for topic in cfg.topics:
        tables = [t for t in cfg.tables if t.topic == topic]
        topic_df = raw_df.where(F.col("topic") == topic)
        if tables[0].format == "debezium":
            names = [f.name for f in schemas[tables[0].name].data.fields]
            parts.append(debezium_envelopes(topic_df, tables[0], names))
        else:
            data = schemas[tables[0].name].data if len(tables) == 1 else None
            parts.append(native_envelopes(topic_df, tables, data))
    union = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    typed = [F.col(f"`{c}`") for c in union.columns if c not in ENVELOPE_COLUMNS]
    return union.select(*ENVELOPE_COLUMNS, *typed)


def table_changes(env_df: DataFrame, schema: TableSchema, unrouted: bool = False, alone: bool = False) -> DataFrame:
    """One table's envelopes with typed key and row columns; contract violations get an ``_error``.

    ``unrouted``: also take the envelopes routed to no table (they keep their envelope's ``_error``), so that one
    table's changes hold every rejected envelope and the tables' changes together hold every envelope.
    ``alone``: the replica has no other table, so every envelope is this table's or unrouted: no routing filter
    (Spark would push it below the envelope's parse and parse every record again to evaluate it).
    """
    table = schema.table
    keys = list(table.keys)
    mine = F.col("_table") == table.name
    staged_df = (
        (env_df if alone else env_df.where(mine | F.col("_table").isNull() if unrouted else mine))
        .withColumn("_k", F.from_json(F.col("_key_json"), _with_corrupt(schema.key_schema), _PERMISSIVE))
        .withColumn("_d", _data(env_df, schema))
    )
    key_struct, data_struct = F.col("_k"), F.col("_d")
    is_upsert = F.col("_op") == "upsert"
    bad_columns = F.concat_ws(
        ", ",
        *[
            F.when(
                F.get_json_object(F.col("_data_json"), f"$.{f.name}").isNotNull() & data_struct[f.name].isNull(),
                F.lit(f"{f.name} ({f.dataType.simpleString()})"),
            )
            for f in schema.data.fields
        ],
    )
    # Which columns are mistyped: one JSON lookup per column, so only for the rows whose data did not parse.
    staged_df = staged_df.withColumn("_bad", F.when(is_upsert & data_struct["_corrupt"].isNotNull(), bad_columns))
    key_missing = reduce(lambda a, b: a | b, [key_struct[k].isNull() for k in keys])
    key_differs = reduce(lambda a, b: a | b, [~key_struct[k].eqNullSafe(data_struct[k]) for k in keys])
    sequenced = table.sequence_by is not None
    if table.sequence_by and table.sequence_by in schema.data.fieldNames():
        row_seq = data_struct[table.sequence_by].cast("long")
        # A Debezium delete's row image is its `before`; a native delete carries no row, its envelope seq orders it.
        seq = row_seq if table.format == "debezium" else F.when(is_upsert, row_seq).otherwise(F.col("_seq"))
    else:
        seq = F.col("_seq")
    error = _first_error(
        (F.col("_error").isNotNull(), F.col("_error")),
        (
            (key_struct.isNull() | key_struct["_corrupt"].isNotNull() | key_missing)
            & F.json_object_keys(F.col("_key_json")).isNull(),
            f"key is not a JSON object of the key columns ({', '.join(keys)})",
        ),
        (
            key_struct["_corrupt"].isNotNull(),
            f"key has a column of the wrong type (expected "
            f"{', '.join(f'{f.name} {f.dataType.simpleString()}' for f in schema.key_schema.fields)})",
        ),
        (key_missing, f"key lacks a key column ({', '.join(keys)})"),
        (
            F.col("_bad") != "",
            F.concat(F.lit("data does not match the table schema: "), F.col("_bad")),
        ),
        (is_upsert & data_struct["_corrupt"].isNotNull(), "data is not a JSON object of the table's columns"),
        (is_upsert & key_differs, "the record key does not match the key columns in data"),
        (
            F.lit(sequenced) & ~F.col("_tombstone") & seq.isNull(),
            f"missing sequence: table {table.name} is ordered by {table.sequence_by}",
        ),
    )
    row_columns = [
        (key_struct[f.name] if f.name in keys else F.when(is_upsert, data_struct[f.name]))
        .cast(f.dataType)
        .alias(f.name)
        for f in schema.kept.fields
    ]
    changes_df = staged_df.select(
        *row_columns,
        F.col("_op"),
        seq.alias("_seq"),
        F.col("_tombstone"),
        F.col("_topic"),
        F.col("_partition"),
        F.col("_offset"),
        F.col("_event_ts"),
        F.col("_kafka_ts"),
        F.col("_key"),
        F.col("_value"),
        F.col("_table"),
        error.alias("_error"),
    )
    # The raw record is kept only where it is quarantined: a valid change's bytes would only weigh on the batch's
    # local checkpoint and on the ordering's shuffle. (A projection of its own: ``_error`` is computed once.)
    rejected_only = F.col("_error").isNotNull()
    return changes_df.withColumns(
        {"_key": F.when(rejected_only, F.col("_key")), "_value": F.when(rejected_only, F.col("_value"))}
    )


def _data(env_df: DataFrame, schema: TableSchema) -> Column:
    """The row of a change, typed: parsed from ``_data_json``, unless the envelope's parse typed it already."""
    parsed = F.from_json(F.col("_data_json"), _with_corrupt(schema.data), _PERMISSIVE)
    name = typed_data_column(schema.table.name)
    if name not in env_df.columns:
        return parsed
    typed = F.col(f"`{name}`")
    fields = [typed[f.name].alias(f.name) for f in schema.data.fields]
    return F.when(typed.isNotNull(), F.struct(*fields, F.lit(None).cast("string").alias("_corrupt"))).otherwise(parsed)


def _with_corrupt(schema: T.StructType) -> T.StructType:
    return T.StructType([*schema.fields, T.StructField("_corrupt", T.StringType())])


def valid(df: DataFrame) -> DataFrame:
    return df.where(F.col("_error").isNull())


def rejected(df: DataFrame) -> DataFrame:
    return df.where(F.col("_error").isNotNull())
