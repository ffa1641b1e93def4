"""Fields a table does not have yet: found in the batch's row images, added as columns or counted.

The decode keeps each upsert's row image as parsed (``decode.ROW``, a variant). The batch's counting job also
merges their schemas (``schema_of_variant_agg``: the names and JSON types of every field seen), so finding a new
field costs no job of its own. A table with ``schema_evolution = "add_columns"`` gains each new field as a nullable
column, typed by the record's Connect schema when a Debezium record has one, else by its JSON values; the batch
is then decoded again with it. A field that cannot become a column (a nested object or array, values of several
JSON types, a name Delta cannot hold), and every new field of a ``strict`` table, is counted instead: the records
that carried it, by field, in the batch's log line and metrics.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from replica_lib import logical
from replica_lib.config import ADD_COLUMNS
from replica_lib.target import TableSchema, widens

#: Names a new column may have (Delta without column mapping refuses spaces and punctuation in names).
_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: A JSON value's type (as ``schema_of_variant`` names it) -> the column a new field of that type becomes.
_JSON_TYPES: dict[str, T.DataType] = {
    "BIGINT": T.LongType(),
    "DOUBLE": T.DoubleType(),
    "STRING": T.StringType(),
    "BOOLEAN": T.BooleanType(),
}

#: A Debezium field's Connect type -> its column; logical types (by name) first.
_CONNECT_TYPES: dict[str, T.DataType] = {
    "int8": T.ShortType(),
    "int16": T.ShortType(),
    "int32": T.IntegerType(),
    "int64": T.LongType(),
    "float32": T.FloatType(),
    "float64": T.DoubleType(),
    "boolean": T.BooleanType(),
    "string": T.StringType(),
}
_CONNECT_LOGICAL: dict[str, T.DataType] = {
    **{name: T.DateType() for name in ("io.debezium.time.Date", "org.apache.kafka.connect.data.Date")},
    **{
        name: T.TimestampType()
        for name in (
            "io.debezium.time.Timestamp",
            "org.apache.kafka.connect.data.Timestamp",
            "io.debezium.time.MicroTimestamp",
            "io.debezium.time.NanoTimestamp",
            "io.debezium.time.ZonedTimestamp",
        )
    },
}
_CONNECT_LOGICAL.update(
    {  # a time of day: kept as its text (Delta has no TIME type; replica_lib.logical reads it so)
        name: T.StringType()
        for name in (
            "io.debezium.time.Time",
            "org.apache.kafka.connect.data.Time",
            "io.debezium.time.MicroTime",
            "io.debezium.time.NanoTime",
        )
    }
)
_CONNECT_DECIMAL = "org.apache.kafka.connect.data.Decimal"
#: A Connect type no column is inferred for: a field of another logical type is a number or bytes in a unit or
#: encoding only its schema knows, so it is counted, never guessed.
_UNTYPED = T.NullType()


#: Integer columns a value may outgrow, smallest first: a value beyond one widens its column to the next that
#: holds it (Delta's type widening), under ``add_columns``.
_NARROW_INTEGERS: tuple[tuple[T.DataType, int], ...] = (
    (T.ByteType(), 2**7),
    (T.ShortType(), 2**15),
    (T.IntegerType(), 2**31),
)


def observations(schema: TableSchema) -> list[Column]:
    """Aggregates for the batch's counting job: the merged schema of the valid upserts' row images (``fields``);
    for Debezium, the Connect field schemas of the newest record that has them (``connect``); for each column of
    a narrow integer type of an ``add_columns`` table, the smallest and greatest value sent (``min:c``, ``max:c``:
    a value its column cannot hold is rejected, so all upserts count here)."""
    ok_upsert = F.col("_error").isNull() & (F.col("_op") == "upsert")
    aggregates = [F.schema_of_variant_agg(F.when(ok_upsert, F.col("_row"))).alias("fields")]
    if schema.table.format == "debezium":
        connect = F.col(logical.CONNECT_FIELDS)
        aggregates.append(F.max_by(connect, F.when(connect.isNotNull(), F.col("_offset"))).alias("connect"))
    elif schema.table.schema_evolution == ADD_COLUMNS:
        narrow = [t for t, _ in _NARROW_INTEGERS]
        for f in schema.kept.fields:
            if f.dataType in narrow and f.name not in schema.table.keys:
                value = F.try_variant_get(F.col("_row"), _path(f.name), "decimal(38,0)")
                aggregates += [F.min(value).alias(f"min:{f.name}"), F.max(value).alias(f"max:{f.name}")]
    return aggregates


@dataclass(frozen=True)
class NewFields:
    """What a batch's row images hold beyond a table's columns."""

    addable: tuple[T.StructField, ...] = ()  # to add as columns (an ``add_columns`` table)
    counted: tuple[tuple[str, str], ...] = ()  # (field, why it is not a column) to count
    widened: tuple[tuple[str, T.DataType], ...] = ()  # columns to widen (an ``add_columns`` table)

    def __bool__(self) -> bool:
        return bool(self.addable or self.counted or self.widened)


def new_fields(schema: TableSchema, observed: Mapping[str, Any]) -> NewFields:
    """The fields of the batch's row images (:func:`observations`) that ``schema`` does not declare."""
    fields = top_level_fields(observed.get("fields"))
    known = {name.lower() for name in schema.data.fieldNames()}
    table = schema.table
    connect = _connect_types(observed.get("connect"))
    addable: list[T.StructField] = []
    counted: list[tuple[str, str]] = []
    for name, json_type in fields:
        if name.lower() in known or json_type == "VOID":  # only nulls so far: nothing to keep yet
            continue
        if table.schema_evolution != ADD_COLUMNS:
            counted.append(
                (name, 'the table is strict: declare it in the schema, or set schema_evolution = "add_columns"')
            )
        elif table.include_columns:
            continue  # the table keeps only the columns it lists
        elif not _PLAIN_NAME.match(name):
            counted.append((name, "its name is not a plain column name: declare it under another name"))
        elif name in connect and connect[name] == _UNTYPED:
            counted.append((name, "its Connect logical type has no column type here: declare it in the schema"))
        elif name in connect:
            addable.append(T.StructField(name, connect[name], True))
        elif json_type in _JSON_TYPES or json_type.startswith("DECIMAL("):  # 1.5 is a DECIMAL(2,1) to a variant
            addable.append(T.StructField(name, _JSON_TYPES.get(json_type, T.DoubleType()), True))
        else:
            counted.append((name, f"its values are {json_type.split('<')[0].lower()}: declare its type in the schema"))
    widened = _widened(schema, observed, connect) if table.schema_evolution == ADD_COLUMNS else []
    return NewFields(tuple(addable), tuple(counted), tuple(widened))


def _widened(
    schema: TableSchema, observed: Mapping[str, Any], connect: dict[str, T.DataType]
) -> list[tuple[str, T.DataType]]:
    """Columns whose values (or Debezium's Connect schema) need a wider type that holds every old value too."""
    result: list[tuple[str, T.DataType]] = []
    for f in schema.kept.fields:
        if f.name in schema.table.keys:
            continue  # a key column never changes type in place (its retained deletes have it too)
        wider = connect.get(f.name)
        if wider is not None and wider != _UNTYPED and widens(f.dataType, wider):
            result.append((f.name, wider))
            continue
        low, high = observed.get(f"min:{f.name}"), observed.get(f"max:{f.name}")
        if low is None or high is None:
            continue
        fits = [t for t, bound in _NARROW_INTEGERS if -bound <= int(low) and int(high) < bound]
        target = fits[0] if fits else T.LongType()
        if widens(f.dataType, target) and int(low) >= -(2**63) and int(high) < 2**63:
            result.append((f.name, target))
    return result


def top_level_fields(text: str | None) -> list[tuple[str, str]]:
    """``OBJECT<a: BIGINT, b: OBJECT<c: STRING>>`` (``schema_of_variant``) -> ``[("a", "BIGINT"), ("b", "OBJECT<…>")]``;
    anything but an object -> []."""
    if not text or not text.startswith("OBJECT<") or not text.endswith(">"):
        return []
    body, result, depth, start = text[len("OBJECT<") : -1], [], 0, 0
    parts: list[str] = []
    quoted = False
    for i, ch in enumerate(body):
        if ch == "`":
            quoted = not quoted
        elif not quoted and ch in "<(":
            depth += 1
        elif not quoted and ch in ">)":
            depth -= 1
        elif not quoted and ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    for part in (p.strip() for p in parts if p.strip()):
        if part.startswith("`"):
            end = part.index("`:", 1) if "`:" in part else len(part)
            name, rest = part[1:end].replace("``", "`"), part[end + 2 :]
        else:
            name, _, rest = part.partition(":")
        result.append((name, rest.strip()))
    return result


def _connect_types(fields: Any) -> dict[str, T.DataType]:
    """Column types by field name from a record's Connect field schemas (``logical.connect_fields``)."""
    types: dict[str, T.DataType] = {}
    for f in fields or []:
        name, kind, logical_name = f["field"], f["type"], f["name"]
        params = f["parameters"] or {}
        if logical_name in _CONNECT_LOGICAL:
            types[name] = _CONNECT_LOGICAL[logical_name]
        elif logical_name == _CONNECT_DECIMAL and str(params.get("scale", "")).isdigit():
            precision = params.get("connect.decimal.precision", "38")
            scale = int(params["scale"])
            types[name] = T.DecimalType(max(int(precision) if str(precision).isdigit() else 38, scale), scale)
        elif logical_name is None and kind in _CONNECT_TYPES:
            types[name] = _CONNECT_TYPES[kind]
        elif kind == "string":  # a logical type carried as text (Json, Uuid, Enum, ...)
            types[name] = T.StringType()
        else:
            types[name] = _UNTYPED
    return types


def _path(name: str) -> str:
    """The variant path of a top-level field (a name with both kinds of quote has none: null)."""
    return f"$['{name}']" if "'" not in name else f'$["{name}"]'


def counts(changes_df: DataFrame, names: Sequence[str]) -> dict[str, int]:
    """How many valid upserts of ``changes_df`` carry each of ``names`` (a job: only when a batch has any);
    -1 for a name no variant path can spell (it holds both kinds of quote)."""
    ok_upsert = F.col("_error").isNull() & (F.col("_op") == "upsert")
    spelled = [name for name in names if not ("'" in name and '"' in name)]
    row = (
        changes_df.where(ok_upsert)
        .select(
            *[
                F.count_if(F.try_variant_get(F.col("_row"), _path(name), "variant").isNotNull()).alias(f"c{i}")
                for i, name in enumerate(spelled)
            ]
        )
        .first()
        if spelled
        else None
    )
    found = {name: int(row[f"c{i}"]) if row is not None else 0 for i, name in enumerate(spelled)}
    return {name: found.get(name, -1) for name in names}
