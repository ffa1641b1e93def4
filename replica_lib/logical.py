"""Kafka Connect and Debezium logical types: the unit or encoding that a record's own schema gives a value.

Debezium's JSON converter sends a timestamp as a count of milli-, micro- or nanoseconds, a date as a count of days
and a DECIMAL as the base64 bytes of its unscaled value; only the record's Connect schema (the ``schema`` block of a
wrapped record) says which. Values are converted by that schema, never by guessing: a number for a TIMESTAMP column
with no unit is refused (decoding quarantines it), and so is a value its column cannot hold exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

#: The envelope column holding the field schemas of a Debezium record's row image (null without a Connect schema).
CONNECT_FIELDS = "_connect_fields"
#: The same for the record's key (its own Connect schema), where the table's key has a DATE or TIMESTAMP column.
KEY_CONNECT_FIELDS = "_key_connect_fields"
#: The type of :data:`CONNECT_FIELDS` and :data:`KEY_CONNECT_FIELDS` (for a null of it): each field's type, logical
#: type and parameters, and an array's element schema (``items``: Debezium sends a PostgreSQL ``date[]`` as an array of
#: day counts whose items are ``io.debezium.time.Date``).
FIELDS_TYPE = (
    "ARRAY<STRUCT<field: STRING, type: STRING, name: STRING, parameters: MAP<STRING, STRING>, "
    "items: STRUCT<type: STRING, name: STRING, parameters: MAP<STRING, STRING>>>>"
)
_KEY_SCHEMA = f"fields {FIELDS_TYPE}"
_CONNECT_SCHEMA = f"fields ARRAY<STRUCT<field: STRING, fields: {FIELDS_TYPE}>>"
#: What Debezium sends for a value it does not have (an unchanged TOASTed column of a PostgreSQL update).
UNAVAILABLE = "__debezium_unavailable_value"

_MILLIS = ("io.debezium.time.Timestamp", "org.apache.kafka.connect.data.Timestamp")
_MICROS = "io.debezium.time.MicroTimestamp"
_NANOS = "io.debezium.time.NanoTimestamp"
_DAYS = ("io.debezium.time.Date", "org.apache.kafka.connect.data.Date")
#: Times of day (PostgreSQL's ``time``): milliseconds (an int32), micro- or nanoseconds since midnight.
_TIME_MILLIS = ("io.debezium.time.Time", "org.apache.kafka.connect.data.Time")
_TIME_MICROS = "io.debezium.time.MicroTime"
_TIME_NANOS = "io.debezium.time.NanoTime"
_TIMES = (*_TIME_MILLIS, _TIME_MICROS, _TIME_NANOS)
#: PostgreSQL's times run from 00:00:00 to 24:00:00 inclusive.
_MAX_TIME_MICROS = 86_400_000_000
_DECIMAL = "org.apache.kafka.connect.data.Decimal"
_VARIABLE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
# Spark's timestamps run from 0001-01-01 to 9999-12-31: microseconds from the epoch, and days.
_MIN_MICROS, _MAX_MICROS = -62_135_596_800_000_000, 253_402_300_799_999_999
_MIN_DAYS, _MAX_DAYS = -719_162, 2_932_896
#: A JSON number as ``get_json_object`` renders it (a string holding only digits looks the same; both are refused
#: for a date or a time; a DECIMAL takes both).
NUMBER_TEXT = r"^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$"

#: The texts a DATE, TIMESTAMP and TIMESTAMP_NTZ column takes (docs/contract.md): ISO 8601's calendar date, for a
#: timestamp alone or with a time of day (hours and minutes at least; at most nine fraction digits, those past the
#: sixth zeros: Spark keeps microseconds) and, for a TIMESTAMP, a zone. Spark's own parser also takes a time alone
#: (on the day it parses it, so a rebuild differs), a year or a month alone, a date followed by anything after a
#: space or a ``T`` (a DATE), eight digits (``20240506`` is a day of the year 57386) and rounds finer fractions away.
_DATE_TEXT = "[0-9]{4}-[0-9]{2}-[0-9]{2}"
_TIME_TEXT = "[T ][0-9]{2}:[0-9]{2}(:[0-9]{2}([.][0-9]{1,6}0{0,3})?)?"
#: A zone is an offset, UTC/GMT/UT (with an offset or not), or a region of the tz database (``Europe/London``). Not
#: an abbreviation: Java reads ``BST`` as Asia/Dhaka, ``CST`` as America/Chicago and ``IST`` as Asia/Kolkata, and
#: Python's ``%Z`` writes them for London's summer, China and Ireland: silently hours off.
_ZONE_TEXT = (
    "(Z|[+-][0-9]{2}(:?[0-9]{2})?| ?(UTC|GMT|UT)([+-][0-9]{1,2}(:?[0-9]{2})?)?"
    "| ?[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)+)?"
)
_TEMPORAL_TEXT: dict[type[T.DataType], str] = {
    T.DateType: f"^{_DATE_TEXT}$",
    T.TimestampType: f"^{_DATE_TEXT}({_TIME_TEXT}{_ZONE_TEXT})?$",
    T.TimestampNTZType: f"^{_DATE_TEXT}({_TIME_TEXT})?$",
}


def connect_fields(schema_text: Column) -> Column:
    """The field schemas of the row image (``after``, else ``before``) in a record's Connect schema, or null."""
    schema = F.from_json(schema_text, _CONNECT_SCHEMA, {"mode": "PERMISSIVE"})

    def image(name: str) -> Column:
        return F.try_element_at(F.filter(schema["fields"], lambda f: f["field"] == name), F.lit(1))["fields"]

    return F.coalesce(image("after"), image("before"))


def key_connect_fields(schema_text: Column) -> Column:
    """The field schemas of a record key's Connect schema (a struct of the key columns), or null."""
    return F.from_json(schema_text, _KEY_SCHEMA, {"mode": "PERMISSIVE"})["fields"]


def is_date_or_time(data_type: T.DataType) -> bool:
    return is_timestamp(data_type) or isinstance(data_type, T.DateType)


def field_schema(name: str, fields: Column) -> Column:
    """Column ``name``'s schema among a record's :func:`connect_fields` (``name``: its logical type, if any)."""
    return F.try_element_at(F.filter(fields, lambda f: f["field"] == name), F.lit(1))


def is_temporal_or_decimal(data_type: T.DataType) -> bool:
    """Whether a column's values may need a unit or an encoding from the record's schema."""
    return isinstance(data_type, (T.TimestampType, T.TimestampNTZType, T.DateType, T.DecimalType))


def by_elements(data_type: T.DataType) -> bool:
    """Whether a column is an ARRAY whose elements may need a unit or an encoding from the record's schema (a time of
    day for an ARRAY<STRING>)."""
    return isinstance(data_type, T.ArrayType) and (
        is_temporal_or_decimal(data_type.elementType) or isinstance(data_type.elementType, T.StringType)
    )


def has_element_unit(name: str, fields: Column) -> Column:
    """Whether a record's schema (``fields``) gives the elements of array column ``name`` a logical type that
    :func:`from_text` converts them by."""
    units = (*_MILLIS, _MICROS, _NANOS, *_DAYS, *_TIMES, _DECIMAL, _VARIABLE_DECIMAL)
    return F.coalesce(field_schema(name, fields)["items"]["name"].isin(*units), F.lit(False))


def is_time(name: str, fields: Column) -> Column:
    """Whether a record's schema (``fields``) gives column ``name`` a time-of-day logical type."""
    return F.coalesce(field_schema(name, fields)["name"].isin(*_TIMES), F.lit(False))


def is_timestamp(data_type: T.DataType) -> bool:
    return isinstance(data_type, (T.TimestampType, T.TimestampNTZType))


def member(name: str) -> str:
    """The JSON path of a top-level field ``name``, for ``get_json_object`` and variants alike: in brackets, so that
    a name with a dot, a space or a bracket is one field (no column name holds a ``'``: replica_lib.config)."""
    return f"$['{name}']"


def wire(name: str) -> Column:
    """A row's value of column ``name`` as its JSON text (a string's content; null where absent or JSON null)."""
    return F.get_json_object(F.col("_data_json"), member(name))


def is_number(text: Column) -> Column:
    return F.coalesce(text.rlike(NUMBER_TEXT), F.lit(False))


#: Why a DECIMAL column refuses a value with non-zero digits past its scale.
BEYOND_SCALE = "more fraction digits than its scale: it would be rounded"


def beyond_scale(text: Column, scale: int) -> Column:
    """Whether ``text``, a number as JSON writes it (``-12.5``, ``1.25e1``; or a string holding one), has a non-zero
    digit past ``scale`` fraction digits, which Spark rounds away in a DECIMAL of that scale; false where ``text`` is
    null, true for an exponent too large to read. Other text gives an answer of no meaning: test it apart.

    Without a regular expression. Without an exponent, the fraction's digits past the scale; with one, the mantissa's
    digits from where the exponent puts the first digit past the scale.
    """
    past = F.substr(F.substring_index(text, ".", -1), F.lit(scale + 1))
    plain = text.contains(".") & (F.translate(past, "0", "") != "")
    lower = F.lower(text)
    exponent = F.substring_index(lower, "e", -1).try_cast("bigint")
    mantissa = F.translate(F.substring_index(lower, "e", 1), "-", "")
    digits = F.translate(mantissa, ".", "")
    # Digit i (from 1) of ``digits`` is fraction digit i - (digits before the point) - exponent.
    first_past = F.length(F.substring_index(mantissa, ".", 1)) + exponent + scale + 1
    scaled = F.substr(digits, F.least(F.greatest(first_past, F.lit(1)), F.length(digits) + 1).cast("int"))
    exponential = F.coalesce(F.translate(scaled, "0", "") != "", F.lit(True))
    return (
        F.when(text.isNull(), F.lit(False)).when(text.contains("e") | text.contains("E"), exponential).otherwise(plain)
    )


def malformed(data_type: T.DataType, text: Column) -> Column:
    """Whether ``text`` (a JSON value's text) is there and not one a DATE, TIMESTAMP or TIMESTAMP_NTZ column of
    ``data_type`` takes (see :data:`_TEMPORAL_TEXT`); false for a column of another type."""
    pattern = _TEMPORAL_TEXT.get(type(data_type))
    if pattern is None:
        return F.lit(False)
    return F.coalesce(~text.rlike(pattern), F.lit(False))


def converted(field: T.StructField, declared: Column) -> Column:
    """A native row's value of column ``field`` as the typed parse read it (``declared``), except that a TIMESTAMP or
    DATE column refuses (null) a number, which the contract sends as a string, and a string not of its form."""
    if is_date_or_time(field.dataType):
        text = wire(field.name)
        refused = is_number(text) | malformed(field.dataType, text)
        return F.when(refused, F.lit(None).cast(field.dataType)).otherwise(declared)
    return declared


def from_text(field: T.StructField, text: Column, fields: Column) -> Column:
    """A Debezium row's or key's value of column ``field`` from its JSON text: by the logical type its schema
    (``fields``) gives it, else cast from the text; a TIMESTAMP or DATE column with no logical type refuses (null) a
    number and a string not of its form (:func:`malformed`)."""
    if isinstance(field.dataType, T.ArrayType):
        return _elements_from_text(field, text, fields)
    plain = text.try_cast(field.dataType)
    if is_date_or_time(field.dataType):
        refused = is_number(text) | malformed(field.dataType, text)
        plain = F.when(refused, F.lit(None).cast(field.dataType)).otherwise(plain)
    schema = field_schema(field.name, fields)
    by_schema = _by_logical_type(field.dataType, schema["name"], schema["parameters"], text)
    if by_schema is None:
        return plain
    return F.when(by_schema[0], by_schema[1]).otherwise(plain)


def _elements_from_text(field: T.StructField, text: Column, fields: Column) -> Column:
    """An ARRAY column's value from its JSON text: each element converted by the logical type the column's schema
    gives its items, the whole value null (refused) if one element is not exact; else parsed as declared."""
    array_type = field.dataType
    assert isinstance(array_type, T.ArrayType)
    plain = F.from_json(text, array_type)
    items = field_schema(field.name, fields)["items"]
    by_schema = _by_logical_type(array_type.elementType, items["name"], items["parameters"], F.lit(""))
    if by_schema is None:
        return plain
    elements = F.from_json(text, "ARRAY<STRING>")  # each element's JSON text (a string's content), null as null

    def element(value: Column) -> Column:
        converted = _by_logical_type(array_type.elementType, items["name"], items["parameters"], value)
        assert converted is not None
        return converted[1]

    values = F.transform(elements, element)
    exact = F.forall(F.zip_with(elements, values, lambda sent, kept: sent.isNull() | kept.isNotNull()), lambda ok: ok)
    return F.when(by_schema[0], F.when(exact, values)).otherwise(plain)


def _by_logical_type(
    data_type: T.DataType, name: Column, parameters: Column, text: Column
) -> tuple[Column, Column] | None:
    """(whether the logical type ``name`` applies, the converted value) for a column of ``data_type``."""
    count = text.try_cast("bigint")
    if is_timestamp(data_type):
        micros = (
            F.when(name.isin(*_MILLIS), F.try_multiply(count, F.lit(1000)))
            .when(name == _MICROS, count)
            .when(name == _NANOS, _exact_div(count, 1000))
        )
        in_range = micros.between(_MIN_MICROS, _MAX_MICROS)
        if isinstance(data_type, T.TimestampNTZType):  # wall-clock time, whatever the session's time zone
            epoch = F.lit("1970-01-01 00:00:00").cast("timestamp_ntz")
            return name.isin(*_MILLIS, _MICROS, _NANOS), F.when(in_range, F.timestamp_add("MICROSECOND", micros, epoch))
        return name.isin(*_MILLIS, _MICROS, _NANOS), F.when(in_range, F.timestamp_micros(micros))
    if isinstance(data_type, T.DateType):
        days = F.when(count.between(_MIN_DAYS, _MAX_DAYS), count.cast("int"))
        return name.isin(*_DAYS), F.date_add(F.lit("1970-01-01").cast("date"), days)
    if isinstance(data_type, T.StringType):  # Delta has no TIME type: a time of day is kept as its text
        micros = (
            F.when(name.isin(*_TIME_MILLIS), F.try_multiply(count, F.lit(1000)))
            .when(name == _TIME_MICROS, count)
            .when(name == _TIME_NANOS, _exact_div(count, 1000))
        )
        return name.isin(*_TIMES), F.when(micros.between(0, _MAX_TIME_MICROS), _time_text(micros))
    if isinstance(data_type, T.DecimalType):
        scale = F.try_element_at(parameters, F.lit("scale")).try_cast("int")
        fixed = _decimal(F.try_to_binary(text, F.lit("base64")), scale, data_type)
        variable = _decimal(
            F.try_to_binary(F.get_json_object(text, "$.value"), F.lit("base64")),
            F.get_json_object(text, "$.scale").try_cast("int"),
            data_type,
        )
        return name.isin(_DECIMAL, _VARIABLE_DECIMAL), F.when(name == _DECIMAL, fixed).otherwise(variable)
    return None


def _time_text(micros: Column) -> Column:
    """Microseconds since midnight as ``HH:MM:SS.ffffff`` (always six fraction digits, so the text sorts as the time
    does; ``CAST(... AS TIME)`` reads it where Spark has TIME)."""
    seconds = F.floor(micros / 1_000_000)
    return F.format_string(
        "%02d:%02d:%02d.%06d",
        F.floor(seconds / 3600),
        F.floor(seconds / 60) % 60,
        seconds % 60,
        micros % 1_000_000,
    )


def _exact_div(count: Column, by: int) -> Column:
    """``count / by`` where it divides exactly (a finer value than Spark keeps is refused, not truncated)."""
    return F.when(F.pmod(count, F.lit(by)) == 0, (count - F.pmod(count, F.lit(by))).cast("decimal(20,0)") / by).cast(
        "bigint"
    )


def _decimal(unscaled_bytes: Column, scale: Column, data_type: T.DecimalType) -> Column:
    """A Connect Decimal (big-endian two's-complement unscaled value, and its scale) as ``data_type``, exactly:
    null where the value needs more digits than the column has, or more fraction digits than its scale."""
    digits = _unsigned_digits(unscaled_bytes)
    negative = F.substr(F.hex(unscaled_bytes), F.lit(1), F.lit(1)).isin(*"89ABCDEF")
    width = F.greatest(F.length(digits), scale + 1)
    padded = F.lpad(digits, width, "0")
    split = width - scale
    text = F.concat(
        F.when(negative, F.lit("-")).otherwise(F.lit("")),
        F.substr(padded, F.lit(1), split),
        F.when(scale > 0, F.concat(F.lit("."), F.substr(padded, split + 1, scale))).otherwise(F.lit("")),
    )
    # Fraction digits beyond the column's scale must be zeros: a cast would round them away.
    extra = F.greatest(scale - data_type.scale, F.lit(0))
    exact = F.regexp_replace(F.substr(padded, width - extra + 1, extra), "0", "") == ""
    in_range = (F.octet_length(unscaled_bytes) <= 16) & scale.between(0, 38)
    return F.when(in_range & exact, text.try_cast(data_type))


def _unsigned_digits(unscaled_bytes: Column) -> Column:
    """The magnitude of a two's-complement big-endian integer, in decimal digits (up to 16 bytes)."""
    hexed = F.hex(unscaled_bytes)
    negative = F.substr(hexed, F.lit(1), F.lit(1)).isin(*"89ABCDEF")
    positions = F.sequence(F.lit(0), F.octet_length(unscaled_bytes) - 1)

    def byte(i: Column) -> Column:
        value = F.conv(F.substr(hexed, i * 2 + 1, F.lit(2)), 16, 10).cast("int")
        return F.when(negative, 255 - value).otherwise(value)  # a negative's magnitude is ~bits + 1

    zero = F.lit(0).cast("decimal(38,0)")
    magnitude = F.aggregate(
        F.transform(positions, byte),
        zero,
        lambda acc, b: F.try_add(F.try_multiply(acc, F.lit(256)), b).cast("decimal(38,0)"),
    )
    magnitude = F.when(negative, F.try_add(magnitude, F.lit(1)).cast("decimal(38,0)")).otherwise(magnitude)
    return F.when(F.octet_length(unscaled_bytes) > 0, magnitude.cast("string"))


def unavailable(fields: Sequence[T.StructField], data: Column) -> Column:
    """The names of the columns of a row (``data``) that hold Debezium's placeholder for a value it did not send,
    comma-separated; empty if none."""
    placeholder = F.lit(UNAVAILABLE)
    checks = []
    for field in fields:
        value = data[field.name]
        if isinstance(field.dataType, T.StringType):
            hit = value == placeholder
        elif isinstance(field.dataType, T.BinaryType):
            hit = value == F.lit(UNAVAILABLE.encode()).cast("binary")
        elif isinstance(field.dataType, T.ArrayType) and isinstance(field.dataType.elementType, T.StringType):
            hit = F.array_contains(value, placeholder)
        else:
            continue
        checks.append(F.when(F.coalesce(hit, F.lit(False)), F.lit(field.name)))
    return F.concat_ws(", ", *checks) if checks else F.lit("")
