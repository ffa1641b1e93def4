"""What a table becomes when its data or its config gains columns (no JVM: the plans only)."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql import types as T

from replica_lib.config import TableConfig, Target
from replica_lib.errors import ConfigError
from replica_lib.evolution import new_fields, top_level_fields
from replica_lib.target import plan_evolution, table_schema, widens

SCHEMA = "id BIGINT, name STRING, qty INT, price DECIMAL(10,2)"


def schema_of(schema: str = SCHEMA, **overrides: Any) -> Any:
    table = TableConfig(name="t", topic="t", keys=("id",), schema=schema, target=Target(path="/x"), **overrides)
    return table_schema(table, "t.toml")


def test_the_fields_of_a_merged_variant_schema_are_read_at_the_top_level_only() -> None:
    text = "OBJECT<a: BIGINT, `b c`: STRING, d: OBJECT<e: DECIMAL(3,1), f: ARRAY<BIGINT>>, g: DECIMAL(4,2)>"
    assert top_level_fields(text) == [
        ("a", "BIGINT"),
        ("b c", "STRING"),
        ("d", "OBJECT<e: DECIMAL(3,1), f: ARRAY<BIGINT>>"),
        ("g", "DECIMAL(4,2)"),
    ]
    assert top_level_fields(None) == [] and top_level_fields("BIGINT") == []


def test_new_fields_are_typed_by_their_json_values_or_counted() -> None:
    fields = "OBJECT<id: BIGINT, Name: STRING, note: STRING, n: BIGINT, ok: BOOLEAN, x: DOUBLE, y: DECIMAL(3,1), "
    fields += "nul: VOID, "
    fields += "o: OBJECT<z: BIGINT>, `a b`: STRING, mixed: VARIANT>"
    found = new_fields(schema_of(), {"fields": fields})
    assert [(f.name, f.dataType) for f in found.addable] == [
        ("note", T.StringType()),
        ("n", T.LongType()),
        ("ok", T.BooleanType()),
        ("x", T.DoubleType()),
        ("y", T.DoubleType()),
    ]
    assert [name for name, _ in found.counted] == ["o", "a b", "mixed"]  # `Name` is `name`: not new
    strict = new_fields(schema_of(schema_evolution="strict"), {"fields": fields})
    assert not strict.addable and [n for n, _ in strict.counted][:2] == ["note", "n"]
    listed = new_fields(schema_of(include_columns=("name",)), {"fields": fields})
    assert not listed.addable and [n for n, _ in listed.counted] == []


def test_a_debezium_field_takes_its_type_from_the_connect_schema() -> None:
    connect = [
        {"field": "born", "type": "int32", "name": "io.debezium.time.Date", "parameters": None},
        {"field": "at", "type": "int64", "name": "io.debezium.time.MicroTimestamp", "parameters": None},
        {
            "field": "cost",
            "type": "bytes",
            "name": "org.apache.kafka.connect.data.Decimal",
            "parameters": {"scale": "2", "connect.decimal.precision": "12"},
        },
        {"field": "small", "type": "int16", "name": None, "parameters": None},
        {"field": "clock", "type": "int64", "name": "io.debezium.time.MicroTime", "parameters": None},
        {"field": "doc", "type": "string", "name": "io.debezium.data.Json", "parameters": None},
        {"field": "span", "type": "float64", "name": "io.debezium.time.MicroDuration", "parameters": None},
    ]
    fields = "OBJECT<born: BIGINT, at: BIGINT, cost: STRING, small: BIGINT, clock: BIGINT, doc: STRING, "
    fields += "span: DOUBLE>"
    found = new_fields(schema_of(format="debezium"), {"fields": fields, "connect": connect})
    assert [(f.name, f.dataType) for f in found.addable] == [
        ("born", T.DateType()),
        ("at", T.TimestampType()),
        ("cost", T.DecimalType(12, 2)),
        ("small", T.ShortType()),
        ("clock", T.StringType()),
        ("doc", T.StringType()),
    ]
    assert [name for name, _ in found.counted] == ["span"]  # a unit only its schema knows: never guessed


def test_widening_is_only_what_keeps_every_value() -> None:
    assert widens(T.IntegerType(), T.LongType()) and widens(T.ByteType(), T.IntegerType())
    assert widens(T.FloatType(), T.DoubleType())
    assert widens(T.DecimalType(10, 2), T.DecimalType(12, 2)) and widens(T.DecimalType(10, 2), T.DecimalType(11, 3))
    assert not widens(T.LongType(), T.IntegerType())
    assert not widens(T.LongType(), T.DoubleType())
    assert not widens(T.DecimalType(10, 2), T.DecimalType(10, 3))  # one digit fewer before the point
    assert not widens(T.StringType(), T.LongType())


def existing(ddl: str) -> T.StructType:
    return table_schema(
        TableConfig(name="t", topic="t", keys=("id",), schema=ddl, target=Target(path="/x")), "t.toml"
    ).data


def test_a_config_change_plans_added_and_widened_columns_and_keeps_columns_added_from_the_data() -> None:
    table = existing("id BIGINT, name STRING, qty SMALLINT, price DECIMAL(10,2), note STRING")
    declared = schema_of("id BIGINT, name STRING, qty INT, price DECIMAL(10,2), city STRING")
    schema, evolution = plan_evolution(table, declared, "t.toml")
    assert [f.name for f in evolution.added] == ["city"]
    assert evolution.widened == (("qty", T.IntegerType()),)
    assert schema.kept.fieldNames() == ["id", "name", "qty", "price", "note", "city"]
    assert "note" in schema.data.fieldNames()
    # A column widened from the data earlier keeps its wider type (the config need not follow).
    wider = existing("id BIGINT, name STRING, qty BIGINT, price DECIMAL(10,2)")
    schema, evolution = plan_evolution(wider, schema_of(), "t.toml")
    assert not evolution and schema.data["qty"].dataType == T.LongType() == schema.kept["qty"].dataType


@pytest.mark.parametrize(
    ("table_ddl", "declared_ddl", "evolution", "names"),
    [
        (
            "id BIGINT, name STRING, qty INT, price DECIMAL(10,2)",
            "id BIGINT, name STRING, qty STRING, price DECIMAL(10,2)",
            "add_columns",
            "qty",
        ),
        (
            "id BIGINT, name STRING, qty INT, price DECIMAL(10,2)",
            "id BIGINT, name STRING, qty SMALLINT, price DECIMAL(10,2)",
            "strict",
            "qty",
        ),
        ("id INT, name STRING, qty INT, price DECIMAL(10,2)", SCHEMA, "add_columns", "id"),
        ("id BIGINT, name STRING, qty INT, price DECIMAL(10,2), note STRING", SCHEMA, "strict", "note"),
    ],
)
def test_what_cannot_be_done_in_place_is_refused_naming_the_column(
    table_ddl: str, declared_ddl: str, evolution: str, names: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        plan_evolution(existing(table_ddl), schema_of(declared_ddl, schema_evolution=evolution), "t.toml")
    assert names in str(refused.value) and "t.toml" in str(refused.value)


def test_values_beyond_a_narrow_integer_column_widen_it_to_the_next_that_holds_them() -> None:
    schema = schema_of("id BIGINT, name STRING, qty SMALLINT, price DECIMAL(10,2), n TINYINT")
    observed = {"fields": "OBJECT<id: BIGINT>", "min:qty": -5, "max:qty": 70_000, "min:n": 0, "max:n": 100}
    assert new_fields(schema, observed).widened == (("qty", T.IntegerType()),)
    observed["max:qty"] = 5_000_000_000
    assert new_fields(schema, observed).widened == (("qty", T.LongType()),)
    assert not new_fields(schema_of(schema_evolution="strict"), observed).widened
    connect = [{"field": "qty", "type": "int64", "name": None, "parameters": None}]
    debezium = schema_of(format="debezium")
    assert new_fields(debezium, {"fields": None, "connect": connect}).widened == (("qty", T.LongType()),)
