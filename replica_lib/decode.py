"""Raw Kafka records -> typed change rows. Every record that breaks the contract gets a reason instead.

Two stages, both pure ``DataFrame -> DataFrame``:

1. :func:`envelopes` reads each record's envelope (native or Debezium) and routes it to a table;
2. :func:`table_changes` types one table's key and row with the table's schema.

Any failure sets ``_error`` (a sentence saying what is wrong); :func:`valid` and :func:`rejected` split on it.
Decoding is strict and total (docs/contract.md, "Edge cases of the contract"): a key or value is valid UTF-8 holding
exactly one strict JSON object (no trailing content, no duplicate field names, no NaN, single quotes or comments),
typed as declared without coercion; every other record is rejected with a reason.
Columns of an envelope row: ``_topic, _partition, _offset, _kafka_ts, _key, _value`` (the raw record, kept for
quarantine; :func:`table_changes` keeps ``_key`` and ``_value`` on rejected changes only), ``_table, _op, _seq,
_event_ts, _tombstone, _key_json, _data_json, _error``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import lru_cache, reduce

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from replica_lib import logical
from replica_lib.config import ReplicaConfig, TableConfig
from replica_lib.target import TableSchema

#: Every typed parse: permissive (a bad record gets a reason, not a failed batch) but with JSON's own syntax only.
_PERMISSIVE = {
    "mode": "PERMISSIVE",
    "columnNameOfCorruptRecord": "_corrupt",
    "allowSingleQuotes": "false",
    "allowNonNumericNumbers": "false",
}
#: How deep a JSON text may nest (the parser's limit); deeper texts are rejected with a reason of their own.
MAX_DEPTH = 1000
_SYNTAX_ONLY = "_x STRING, _corrupt STRING"
_NOT_JSON = "not valid JSON (NaN, Infinity, single quotes, comments and leading zeros are not JSON)"
#: First characters of the text Spark makes of a number, boolean, object or array read into a STRING field.
_COERCED_STARTS = ("-", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "t", "f", "{", "[")
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
    "_row",
)
#: The column of a change holding its row image as parsed (a variant; null for deletes): what the batch reads the
#: fields of to find those its table does not have (``replica_lib.evolution``). Dropped once observed.
ROW = "_row"


#: One step of a decode: a projection or a filter of the frame, its expressions already built.
Step = Callable[[DataFrame], DataFrame]
#: Schemas whose decode steps are kept (a replica has one per table, and a new one per evolution of a table).
_CACHED_SCHEMAS = 64


def _apply(df: DataFrame, steps: Sequence[Step]) -> DataFrame:
    """``df`` through ``steps``.

    A decode's expressions are unresolved and depend only on the table's schema, not on the batch: they are built
    once per schema (:data:`_CACHED_SCHEMAS`) and applied to every batch (a one-table replica's, once, to its
    query: :func:`stream_changes`). Building them is thousands of calls into the JVM, which would cost every batch
    about half a second of the driver's time.
    """
    for step in steps:
        df = step(df)
    return df


def _select(*columns: Column) -> Step:
    return lambda df: df.select(*columns)


def _with(name: str, column: Column) -> Step:
    return lambda df: df.withColumn(name, column)


def _no_error() -> Column:
    return F.lit(None).cast("string")


#: The Kafka source's columns of a record, and what a change names them (:func:`_raw`, and back: :func:`records`).
_RAW_NAMES = (
    ("topic", "_topic"),
    ("partition", "_partition"),
    ("offset", "_offset"),
    ("timestamp", "_kafka_ts"),
    ("key", "_key"),
    ("value", "_value"),
)


def _raw() -> Step:
    return _select(*[F.col(source).alias(name) for source, name in _RAW_NAMES])


#: What :func:`_strict` appends to a text: the parser must read it as the array's last element.
_SENTINEL = 7


def _strict(text: Column) -> Column:
    """``[text,7]`` parsed strictly (a variant): null if it is not JSON, nests too deep or repeats a field name at
    any depth. Its element 0 is the text's JSON value; the sentinel 7 must be element 1 and the last."""
    return F.try_parse_json(F.concat(F.lit("["), text, F.lit(f",{_SENTINEL}]")))


def _single(text: Column, strict: Column) -> Column:
    """Whether ``text`` is exactly one strict JSON value (whitespace around it allowed).

    The parser ignores what follows the value it read, so the text is parsed inside ``[text,7]``: a text of one value
    leaves the 7 second and last (a second value pushes it back, garbage breaks the array). A text can only end that
    array early with a ``]`` of its own; such texts are parsed once more inside ``{"k": text}``, which no text can
    close both ways.
    """
    sentinel_second = F.try_variant_get(strict, "$[1]", "int") == _SENTINEL  # so the text gave one element
    last = F.try_variant_get(strict, "$[2]", "variant").isNull()  # copies a value only where there is one
    closed = F.try_parse_json(F.concat(F.lit('{"k":'), text, F.lit("}"))).isNotNull()
    one = sentinel_second & last & F.when(text.contains("]"), closed).otherwise(F.lit(True))
    return F.coalesce(one, F.lit(False))  # null where the text did not parse


def _is_object(strict: Column) -> Column:
    return F.startswith(F.schema_of_variant(F.try_variant_get(strict, "$[0]", "variant")), F.lit("OBJECT"))


def _not_string(strict: Column, path: str) -> Column:
    """Whether the JSON value at ``path`` of a :func:`_strict` variant is there and not a string."""
    kind = F.schema_of_variant(F.try_variant_get(strict, path, "variant"))
    return kind.isNotNull() & (kind != "STRING") & (kind != "VOID")


def _is_string(strict: Column, path: str) -> Column:
    """Whether the JSON value at ``path`` of a variant is a string (false where it is absent)."""
    kind = F.schema_of_variant(F.try_variant_get(strict, path, "variant"))
    return F.coalesce(kind == "STRING", F.lit(False))


def _looks_coerced(value: Column) -> Column:
    """Whether a STRING read by ``from_json`` may be a number, boolean, object or array turned into text (cheap;
    only such values are looked up in the strict parse)."""
    return value.isNotNull() & F.substring(value, 1, 1).isin(*_COERCED_STARTS)


def _field_path(*names: str) -> str:
    return "$[0]" + "".join(f"['{n}']" for n in names)


#: What :func:`_syntax_step` finds of a text that is not one strict JSON value: it breaks JSON's syntax, and
#: only because it nests too deep.
_BAD_SYNTAX, _TOO_DEEP = 1, 2


def _syntax_step(raw: Column, single: Column, name: str) -> Step:
    """The step that puts in ``name`` what JSON's syntax says of the bytes ``raw``: null where ``single`` holds,
    else 0, :data:`_BAD_SYNTAX` or :data:`_TOO_DEEP` (read by :func:`_text_checks`).

    A projection of its own, read twice by the checks so that Spark keeps it apart: Spark interprets
    ``from_json``, so a projection holding one runs outside whole-stage code generation and every task generates
    its code again; kept to the parse alone, the checks are generated once per batch.
    """
    text = raw.cast("string")
    syntax = F.from_json(text, _SYNTAX_ONLY, _PERMISSIVE)
    deep = F.from_json(text, _SYNTAX_ONLY, {**_PERMISSIVE, "maxNestingDepth": str(100 * MAX_DEPTH)})
    only_too_deep = deep.isNotNull() & deep["_corrupt"].isNull()
    found = F.when(syntax.isNotNull() & syntax["_corrupt"].isNull(), 0).when(only_too_deep, _TOO_DEEP)
    return _with(name, F.when(~single, found.otherwise(_BAD_SYNTAX)))


#: A ``\\u`` escape of a high surrogate not followed by a low one, or of a low one not after a high one: valid JSON
#: syntax that names no Unicode character, which the strict parse refuses (an escaped backslash is not an escape).
_UNPAIRED_SURROGATE = (
    r"(?<!\\)(?:\\\\)*"
    r"(?:\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)


def _no_unpaired_surrogate(text: Column) -> Column:
    """Whether ``text`` has no :data:`_UNPAIRED_SURROGATE` (a typed parse reads one, and its UTF-8 bytes hold a
    ``?`` in its place). A text without a ``\\u`` escape costs one scan for it, not the regular expression."""
    return ~text.contains("\\u") | ~text.rlike(_UNPAIRED_SURROGATE)


def _text_checks(
    raw: Column, single: Column, syntax: Column, what: str, not_object: str
) -> list[tuple[Column, Column | str]]:
    """Why the bytes ``raw`` are not exactly one strict JSON value, first reason first (see :func:`_first_error`).

    ``single`` is :func:`_single` of the text and ``syntax`` the column of its :func:`_syntax_step`, each computed
    once. Everything past the UTF-8 check is evaluated only for a text that is not one strict JSON value, so a valid
    record pays for none of the parses.
    """
    text = raw.cast("string")
    return [
        (~F.is_valid_utf8(text), f"{what} is not valid UTF-8"),
        (F.octet_length(raw) == 0, f"{what} is empty (zero bytes)"),
        (~single & (syntax == _TOO_DEEP), f"{what} nests deeper than {MAX_DEPTH} levels"),
        (~single & (syntax >= _BAD_SYNTAX), f"{not_object}: {_NOT_JSON}"),
        (~single & text.rlike(_UNPAIRED_SURROGATE), f"{what} has a \\u escape of half a surrogate pair (no character)"),
        (~single & F.try_parse_json(text).isNull(), f"{what} has a duplicate field name"),
        (~single, f"{what} has content after its JSON object"),
    ]


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
    return _apply(raw_df, _native_steps(tuple(tables), data))


@lru_cache(maxsize=_CACHED_SCHEMAS)
def _native_steps(tables: tuple[TableConfig, ...], data: T.StructType | None) -> tuple[Step, ...]:
    parse, clean = _native_parse(data)
    head = (_raw(), *parse, _syntax_step(F.col("_value"), F.col("_single"), "_value_syntax"))
    env = F.col("_env")
    is_tombstone = F.col("_value").isNull()
    table, route_error = _route(tables, env["table"])
    typed_columns = (
        [] if data is None else [F.when(clean, F.col("_typed")["data"]).alias(typed_data_column(tables[0].name))]
    )
    one_table = F.lit(tables[0].name) if len(tables) == 1 else F.lit(None).cast("string")
    return *head, _select(
        *_raw_columns(),
        F.when(is_tombstone, one_table).otherwise(table).alias("_table"),
        F.when(is_tombstone, F.lit("delete")).otherwise(env["op"]).alias("_op"),
        F.when(is_tombstone, F.lit(None).cast("long")).otherwise(env["seq"]).alias("_seq"),
        _event_ts(env["ts_ms"]).alias("_event_ts"),
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
        .otherwise(_native_error(route_error))
        .alias("_error"),
        F.when(~is_tombstone, F.try_variant_get(F.col("_strict"), "$[0]['data']", "variant")).alias(ROW),
        *typed_columns,
    )


def _native_parse(data: T.StructType | None) -> tuple[tuple[Step, ...], Column]:
    """The steps that put the strict parse in ``_strict``, whether the text is one strict JSON value in ``_single``
    and the envelope in ``_env`` (and, given ``data``, the typed parse in ``_typed``), and the condition under which a
    record was taken cleanly by the typed parse (always false without ``data``)."""
    text = F.col("_value").cast("string")
    single = F.is_valid_utf8(text) & _single(text, F.col("_strict"))
    if data is None:
        untyped_env = _with("_env", F.from_json(text, NATIVE_ENVELOPE, _PERMISSIVE))
        return (_with("_strict", _strict(text)), _with("_single", single), untyped_env), F.lit(False)
    typed_step = _with("_typed", F.from_json(text, _typed_envelope(data), _PERMISSIVE))
    typed = F.col("_typed")
    # A record the typed parse proves plain skips the strict parse (with its checks, the dearer half of the decode).
    plain = F.col("_plain")
    # Each DECIMAL value's text, once: the checks of the plain value read it several times, under conditions that keep
    # Spark from computing it once for them.
    numbers = [_with(_number_column(i), _number_text(text, f.name)) for i, f in _plain_decimals(data)]
    proof = (
        *numbers,
        _with("_plain", _plain_value(text, typed, data)),
        _with("_strict", F.when(~plain, _strict(text))),
        _with("_single", F.when(plain, F.lit(True)).otherwise(single)),
    )
    # A clean record is also exactly one strict JSON text in UTF-8 with no value coerced into a STRING column.
    coerced = [
        _looks_coerced(typed["data"][f.name]) & _not_string(F.col("_strict"), _field_path("data", f.name))
        for f in data.fields
        if isinstance(f.dataType, T.StringType)
    ]
    # A number read into a TIMESTAMP or DATE column (as seconds, or not at all) has no unit, and a string not of the
    # column's form is read by Spark's lenient parser: the record takes the untyped path, where it is refused
    # (replica_lib.logical). So is a string read into a DECIMAL column that is not a number as JSON writes one
    # (Spark drops its commas).
    coerced += [
        typed["data"][f.name].isNotNull()
        & (
            _not_string(F.col("_strict"), _field_path("data", f.name))
            | logical.malformed(f.dataType, F.try_variant_get(F.col("_strict"), _field_path("data", f.name), "string"))
        )
        for f in data.fields
        if logical.is_date_or_time(f.dataType)
    ]
    # Spark's reader does not check the values nested in an ARRAY, MAP or STRUCT column as the contract does, nor
    # the range of a TINYINT's.
    coerced += [
        _nested_mismatch(f.dataType, F.try_variant_get(F.col("_strict"), _field_path("data", f.name), "variant"))
        for f in data.fields
        if _nests(f.dataType) or isinstance(f.dataType, T.ByteType)
    ]
    coerced += [
        typed["data"][f.name].isNotNull()
        & _is_string(F.col("_strict"), _field_path("data", f.name))
        & ~logical.is_number(F.try_variant_get(F.col("_strict"), _field_path("data", f.name), "string"))
        for f in data.fields
        if isinstance(f.dataType, T.DecimalType)
    ]
    clean_step = _with(
        "_clean",
        reduce(
            lambda a, b: a & ~b,
            coerced,
            typed.isNotNull() & typed["_corrupt"].isNull() & typed["op"].isNotNull() & F.col("_single"),
        ),
    )
    clean = F.col("_clean")
    fields = [typed[f].alias(f) for f in ("op", "seq", "ts_ms", "table")]
    untyped = F.from_json(text, NATIVE_ENVELOPE, _PERMISSIVE)  # evaluated only where ``clean`` is false
    # `data` is only tested for presence on a clean record (its typed form is in the typed column).
    present = F.when(typed["data"].isNotNull(), F.lit("")).cast("string").alias("data")
    none = F.lit(None).cast("string").alias("_corrupt")
    env_step = _with("_env", F.when(clean, F.struct(*fields, present, none)).otherwise(untyped))
    return (typed_step, *proof, clean_step, env_step), clean


def _plain_value(text: Column, typed: Column, data: T.StructType) -> Column:
    """Whether a native record is, without a strict parse, exactly one strict JSON object of envelope and row fields
    that its typed parse ``typed`` read, each once, none a value turned into a string: no second parse is needed.

    As :func:`_plain_key` for keys. The typed parse read a strict JSON object from the text's first character, every
    field it read non-null takes one ``:`` of its own, and every object one ``{`` and one ``}``. So a text that also
    has exactly that many of each (and no ``[`` or ``]``) and ends with the object's ``}`` has no other field, no
    field twice, no null field (but a delete's ``data``), no colon or brace inside a string and nothing after the
    object; a STRING value that starts like a number, boolean or object is then told from one by the text
    (:func:`_given_as_string`). Every other record (a row with nested columns, a time or date that may be a bare
    number, any brace or colon in a string) takes the strict parse and its checks, as before.
    """
    if not all(isinstance(f.dataType, T.AtomicType) for f in data.fields):
        return F.lit(False)
    row = typed["data"]
    read = [typed[name] for name in sorted(_ENVELOPE_FIELDS - {"_corrupt"})] + [row[f.name] for f in data.fields]
    # A delete's ``"data": null`` (as the producer writes it) is the one null field that takes its colon.
    null_data = F.when(row.isNull() & text.rlike(_field_value("data") + "null"), 1).otherwise(0)
    fields = reduce(lambda a, b: a + b, [F.when(c.isNotNull(), 1).otherwise(0) for c in read], null_data)
    objects = F.when(row.isNotNull(), 2).otherwise(1)
    # A row's STRING value that may be a coerced one is one when the text gives it as a string; an envelope's is not.
    strings = [~_looks_coerced(typed["op"]), ~_looks_coerced(typed["table"])]
    strings += [
        ~_looks_coerced(row[f.name]) | (F.lit(f.name not in _ENVELOPE_FIELDS) & _given_as_string(text, f.name))
        for f in data.fields
        if isinstance(f.dataType, T.StringType)
    ]
    temporal = [row[f.name] for f in data.fields if logical.is_date_or_time(f.dataType)]
    # Jackson reads 128..255 into a TINYINT as -128..-1 (a byte's bits): a negative one takes the strict parse.
    tiny = [F.coalesce(row[f.name] >= 0, F.lit(True)) for f in data.fields if isinstance(f.dataType, T.ByteType)]
    # A DECIMAL column's value must be a number, or a string holding one as JSON writes it: Spark reads any string.
    # And Spark rounds one with more fraction digits than the column's scale: only the text tells.
    strings += [
        row[f.name].isNull()
        | (
            F.lit(f.name not in _ENVELOPE_FIELDS)
            & (_given_as_number(text, f.name) | _number_string(text, f.name))
            & _exact_in_scale(F.col(_number_column(i)), _scale(f))
        )
        for i, f in _plain_decimals(data)
    ]
    checks = [
        typed.isNotNull(),
        typed["_corrupt"].isNull(),
        typed["op"].isin("upsert", "delete"),
        F.startswith(text, F.lit("{")),
        F.endswith(text, F.lit("}")),
        ~text.contains("["),  # a scan for the byte; ``instr`` calls a comparison at every byte
        ~text.contains("]"),
        *strings,
        *[t.isNull() for t in temporal],
        *tiny,
        _count(text, ":") == fields,
        _count(text, "{") == objects,
        _count(text, "}") == objects,
        F.is_valid_utf8(text),
        _no_unpaired_surrogate(text),
    ]
    return F.coalesce(reduce(lambda a, b: a & b, checks), F.lit(False))


#: JSON's white space, as a regular expression.
_BLANK = "[ \\t\\n\\r]*"
#: The native envelope's fields: a row column of the same name is not looked up by name in the text.
_ENVELOPE_FIELDS = frozenset(column.split()[0] for column in NATIVE_ENVELOPE.split(", "))


def _field_value(name: str) -> str:
    """A regular expression of a field ``name`` and its colon, white space around it: what its value follows."""
    return '"' + re.escape(name) + '"' + _BLANK + ":" + _BLANK


def _given_as_string(text: Column, name: str) -> Column:
    """Whether the first value of a field ``name`` in ``text`` starts with a quote: a JSON string, not a number,
    boolean or object that a typed parse turns into text.

    Exact in a plain value (:func:`_plain_value`), whose every colon is a field's: no string holds ``"name":``, the
    field is there once, under its own name. A name written with escapes is not found (the record is then not plain).
    The spelling without white space is looked up first as plain text: a regular expression costs a scan of its own.
    """
    compact = text.contains(f'"{name}":"')
    return compact | (F.regexp_extract(text, _field_value(name) + "(.)", 1) == '"')


_NUMBER_STARTS = ("-", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9")


def _given_as_number(text: Column, name: str) -> Column:
    """Whether the first value of a field ``name`` in ``text`` starts like a JSON number; exact in a plain value, as
    :func:`_given_as_string` (a name written with escapes is not found: the record is then not plain).

    The spellings ``"name":`` and ``"name": `` are read at the name's first place; other white space costs a
    regular expression.
    """
    key = f'"{name}":'
    at = F.instr(text, key)
    after = F.substr(text, at + len(key), F.lit(2))
    first, second = F.substr(after, F.lit(1), F.lit(1)), F.substr(after, F.lit(2), F.lit(1))
    near = (at > 0) & (first.isin(*_NUMBER_STARTS) | ((first == " ") & second.isin(*_NUMBER_STARTS)))
    spaced = F.regexp_extract(text, _field_value(name) + "(.)", 1)
    return F.coalesce(near | spaced.isin(*_NUMBER_STARTS), F.lit(False))


def _number_string(text: Column, name: str) -> Column:
    """Whether a field ``name`` of ``text`` is a string holding a JSON number (``"12.50"``); exact in a plain value,
    whose only ``"name":`` is the field's own."""
    return F.coalesce(text.rlike(_field_value(name) + '"' + logical.NUMBER_TEXT.strip("^$") + '"'), F.lit(False))


def _plain_decimals(data: T.StructType) -> list[tuple[int, T.StructField]]:
    """The DECIMAL columns of ``data``, numbered, where a record of it can be plain (see :func:`_plain_value`)."""
    if not all(isinstance(f.dataType, T.AtomicType) for f in data.fields):
        return []
    return [(i, f) for i, f in enumerate(data.fields) if isinstance(f.dataType, T.DecimalType)]


def _scale(field: T.StructField) -> int:
    assert isinstance(field.dataType, T.DecimalType)
    return field.dataType.scale


def _number_column(i: int) -> str:
    return f"_number_{i}"


def _exact_in_scale(number_text: Column, scale: int) -> Column:
    """Whether a number's text (null: not found) holds a value a DECIMAL of ``scale`` keeps without rounding."""
    return F.when(number_text.isNull(), F.lit(False)).otherwise(~logical.beyond_scale(number_text, scale))


def _number_text(text: Column, name: str) -> Column:
    """The text of a field ``name``'s value that is a number or a string holding one, without its quotes; null where
    the spelling ``"name":`` is not found (the record then takes the strict parse). Exact in a plain value, as
    :func:`_given_as_number`: the name is there once, and a number ends at the next ``,`` or ``}``.

    By bytes only: ``substring_index`` finds a text as bytes, where ``instr`` and ``substr`` count characters.
    """
    rest = F.substring_index(text, f'"{name}":', -1)
    value = F.substring_index(F.substring_index(rest, ",", 1), "}", 1)
    return F.when(F.octet_length(rest) < F.octet_length(text), F.translate(value, ' "\t\n\r', ""))


def _native_error(route_error: Column) -> Column:
    """Why a native record is not a change of one of its topic's tables (null if it is one)."""
    env, strict = F.col("_env"), F.col("_strict")
    op = env["op"]
    wrong_type = "envelope has a field of the wrong type (op and table are strings, seq and ts_ms integers)"
    return _first_error(
        (F.col("_key").isNull(), "missing key: the Kafka record key is null"),
        (F.col("_value").isNull(), _no_error()),
        *_text_checks(F.col("_value"), F.col("_single"), F.col("_value_syntax"), "value", "value is not a JSON object"),
        (_suspect(env, "op") & ~_is_object(strict), "value is not a JSON object"),
        (env["_corrupt"].isNotNull(), wrong_type),
        (~_in_time_range(env["ts_ms"]), f"envelope's ts_ms {_NOT_A_TIME}"),
        (op.isNull(), "missing op"),
        (~op.isin("upsert", "delete") & _not_string(strict, _field_path("op")), wrong_type),
        (
            ~op.isin("upsert", "delete"),
            F.concat(F.lit("unknown op '"), op, F.lit("' (expected upsert or delete)")),
        ),
        (route_error.isNotNull() & _not_string(strict, _field_path("table")), wrong_type),
        (route_error.isNotNull(), route_error),
        ((op == "upsert") & env["data"].isNull(), "upsert without data"),
    )


def _typed_envelope(data: T.StructType) -> T.StructType:
    envelope = T.DataType.fromDDL(NATIVE_ENVELOPE)
    assert isinstance(envelope, T.StructType)
    return T.StructType([f if f.name != "data" else T.StructField("data", data) for f in envelope.fields])


def debezium_envelopes(
    raw_df: DataFrame, table: TableConfig, data_columns: Sequence[str], dated_keys: bool = False
) -> DataFrame:
    """Envelopes of Debezium's JSON format, with or without the ``schema``/``payload`` wrapper.

    ``dated_keys``: the table's key has a DATE or TIMESTAMP column, which a key with a Connect schema sends as a count
    in the unit of its logical type: the key's field schemas are kept (:data:`logical.KEY_CONNECT_FIELDS`).
    """
    return _apply(raw_df, _debezium_steps(table, tuple(data_columns), dated_keys))


@lru_cache(maxsize=_CACHED_SCHEMAS)
def _debezium_steps(table: TableConfig, data_columns: tuple[str, ...], dated_keys: bool) -> tuple[Step, ...]:
    text = F.col("_value").cast("string")
    key_text = F.col("_key").cast("string")
    outer = F.col("_outer")
    wrapped = outer["payload"].isNotNull() & outer["op"].isNull()
    staged = (
        _raw(),
        _with("_strict", _strict(text)),
        _with("_single", _single(text, F.col("_strict"))),
        _syntax_step(F.col("_value"), F.col("_single"), "_value_syntax"),
        _with("_outer", F.from_json(text, DEBEZIUM_OUTER, _PERMISSIVE)),
        _with("_payload_text", F.when(wrapped, outer["payload"]).otherwise(text)),
        _with("_payload", F.from_json(F.col("_payload_text"), DEBEZIUM_PAYLOAD, _PERMISSIVE)),
        _with("_key_outer", F.from_json(key_text, "schema STRING, payload STRING")),
    )
    payload_text, payload, key_outer = F.col("_payload_text"), F.col("_payload"), F.col("_key_outer")
    key_wrapped = key_outer["schema"].isNotNull() & key_outer["payload"].isNotNull()
    key_json = F.when(key_wrapped, key_outer["payload"]).otherwise(key_text)
    is_tombstone = F.col("_value").isNull()
    dbz_op = payload["op"]
    is_upsert = dbz_op.isin(*_DEBEZIUM_UPSERT_OPS)
    # Fields read by path, as text: a value that is not a whole number of BIGINT's range is refused (a cast would
    # fail the batch).
    source_ts_text = F.get_json_object(payload["source"], "$.ts_ms")
    source_ts = source_ts_text.try_cast("long")
    event_ms = F.coalesce(source_ts, payload["ts_ms"])
    seq_text: Column = F.lit(None).cast("string")
    if table.sequence_by and table.sequence_by not in data_columns:
        seq_text = F.get_json_object(payload_text, f"$.{table.sequence_by}")
    seq = seq_text.try_cast("long")
    error = _first_error(
        (F.col("_key").isNull(), "missing key: the Kafka record key is null"),
        (is_tombstone, _no_error()),
        *_text_checks(F.col("_value"), F.col("_single"), F.col("_value_syntax"), "value", "value is not a JSON object"),
        (_suspect(outer, "payload", "op") & ~_is_object(F.col("_strict")), "value is not a JSON object"),
        (payload["_corrupt"].isNotNull(), "Debezium payload has a field of the wrong type"),
        (dbz_op.isNull(), "missing op in the Debezium payload"),
        (
            ~dbz_op.isin(*_DEBEZIUM_UPSERT_OPS, "d"),
            F.concat(F.lit("unsupported Debezium op '"), dbz_op, F.lit("' (expected c, r, u or d)")),
        ),
        (is_upsert & payload["after"].isNull(), "Debezium change without 'after'"),
        (source_ts_text.isNotNull() & source_ts.isNull(), "Debezium source.ts_ms is not a whole number"),
        (~_in_time_range(event_ms), f"Debezium ts_ms {_NOT_A_TIME}"),
        (
            seq_text.isNotNull() & seq.isNull(),
            f"Debezium {table.sequence_by} (the table's sequence) is not a whole number of BIGINT's range",
        ),
    )
    return *staged, _select(
        *_raw_columns(),
        F.lit(table.name).alias("_table"),
        F.when(is_tombstone | (dbz_op == "d"), F.lit("delete")).otherwise(F.lit("upsert")).alias("_op"),
        F.when(is_tombstone, F.lit(None).cast("long")).otherwise(seq).alias("_seq"),
        _event_ts(event_ms).alias("_event_ts"),
        is_tombstone.alias("_tombstone"),
        key_json.alias("_key_json"),
        # A delete's row image is `before`: only its sequence column is used (see table_changes).
        F.when(is_upsert, payload["after"]).when(dbz_op == "d", payload["before"]).alias("_data_json"),
        error.alias("_error"),
        F.when(
            is_upsert,
            F.coalesce(
                F.try_variant_get(F.col("_strict"), "$[0]['payload']['after']", "variant"),
                F.try_variant_get(F.col("_strict"), "$[0]['after']", "variant"),
            ),
        ).alias(ROW),
        F.when(wrapped & ~is_tombstone, logical.connect_fields(outer["schema"])).alias(logical.CONNECT_FIELDS),
        *(
            [F.when(key_wrapped, logical.key_connect_fields(key_outer["schema"])).alias(logical.KEY_CONNECT_FIELDS)]
            if dated_keys
            else []
        ),
    )


#: The milliseconds of Spark's (and Python's) times: 0001-01-01 to 9999-12-31. A ts_ms beyond overflows a
#: timestamp (which would fail the batch) or leaves the calendar most readers know.
_MIN_MS, _MAX_MS = -62_135_596_800_000, 253_402_300_799_999
_NOT_A_TIME = "is not a time in milliseconds between 0001-01-01 and 9999-12-31"


def _in_time_range(ms: Column) -> Column:
    """Whether milliseconds ``ms`` (a BIGINT) are null or within :data:`_MIN_MS` to :data:`_MAX_MS`."""
    return F.coalesce(ms.between(_MIN_MS, _MAX_MS), F.lit(True))


def _event_ts(ms: Column) -> Column:
    """The change's event time from its milliseconds; null where out of range (the record is refused then)."""
    return F.timestamp_millis(F.when(ms.between(_MIN_MS, _MAX_MS), ms))


def _raw_columns() -> list[Column]:
    return [F.col(c) for c in ("_topic", "_partition", "_offset", "_kafka_ts", "_key", "_value")]


def envelopes(raw_df: DataFrame, cfg: ReplicaConfig, schemas: dict[str, TableSchema]) -> DataFrame:
    """Every record of the batch as an envelope row, routed to its table (or given an ``_error``)."""
    parts = []
    for topic in cfg.topics:
        tables = [t for t in cfg.tables if t.topic == topic]
        topic_df = raw_df.where(F.col("topic") == topic)
        if tables[0].format == "debezium":
            schema = schemas[tables[0].name]
            names = [f.name for f in schema.data.fields]
            dated = any(logical.is_date_or_time(f.dataType) for f in schema.key_schema.fields)
            parts.append(debezium_envelopes(topic_df, tables[0], names, dated))
        else:
            data = schemas[tables[0].name].data if len(tables) == 1 else None
            parts.append(native_envelopes(topic_df, tables, data))
    union = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    typed = [F.col(f"`{c}`") for c in union.columns if c not in ENVELOPE_COLUMNS]
    return union.select(*ENVELOPE_COLUMNS, *typed)


def table_changes(
    env_df: DataFrame, schema: TableSchema, unrouted: bool = False, alone: bool = False, keep_raw: bool = False
) -> DataFrame:
    """One table's envelopes with typed key and row columns; contract violations get an ``_error``.

    ``keep_raw``: keep every change's raw record, not only a rejected one's (a valid change may be held back
    behind a quarantined record of its key, and is then quarantined with its bytes).

    ``unrouted``: also take the envelopes routed to no table (they keep their envelope's ``_error``), so that one
    table's changes hold every rejected envelope and the tables' changes together hold every envelope.
    ``alone``: the replica has no other table, so every envelope is this table's or unrouted: no routing filter
    (Spark would push it below the envelope's parse and parse every record again to evaluate it).
    """
    # What of the envelope's columns the expressions depend on (besides the schema): whether it holds the rows
    # typed already, and the records' Debezium field schemas.
    present = frozenset(env_df.columns) & {
        typed_data_column(schema.table.name),
        logical.CONNECT_FIELDS,
        logical.KEY_CONNECT_FIELDS,
    }
    return _apply(env_df, _table_steps(schema, present, unrouted, alone, keep_raw))


@lru_cache(maxsize=_CACHED_SCHEMAS)
def _table_steps(
    schema: TableSchema, present: frozenset[str], unrouted: bool, alone: bool, keep_raw: bool
) -> tuple[Step, ...]:
    table = schema.table
    mine = F.col("_table") == table.name
    routed = mine | F.col("_table").isNull() if unrouted else mine
    routing: tuple[Step, ...] = () if alone else (lambda df: df.where(routed),)
    staged = (*routing, *_typed_key_and_data(present, schema))
    seq = _sequence(schema)
    error = _first_error(
        (F.col("_error").isNotNull(), F.col("_error")),
        *_key_checks(schema),
        *_data_checks(schema),
        (
            ~F.col("_tombstone") & _sequence_overflows(schema, seq),
            f"sequence {table.sequence_by} is beyond BIGINT's range (the table is ordered by it as a BIGINT)",
        ),
        (
            F.lit(table.sequence_by is not None) & ~F.col("_tombstone") & seq.isNull(),
            f"missing sequence: table {table.name} is ordered by {table.sequence_by}",
        ),
    )
    is_upsert = F.col("_op") == "upsert"
    row_columns = [
        (F.col("_k")[f.name] if f.name in table.keys else F.when(is_upsert, F.col("_d")[f.name]))
        .cast(f.dataType)
        .alias(f.name)
        for f in schema.kept.fields
    ]
    changes = _select(
        *row_columns,
        F.col("_op"),
        seq.alias("_seq"),
        *[F.col(c) for c in ("_tombstone", "_topic", "_partition", "_offset", "_event_ts", "_kafka_ts")],
        *[F.col(c) for c in ("_key", "_value", "_table")],
        error.alias("_error"),
        F.when(F.col("_op") == "upsert", F.col(ROW)).alias(ROW),
        (F.col(logical.CONNECT_FIELDS) if logical.CONNECT_FIELDS in present else F.lit(None)).alias(
            logical.CONNECT_FIELDS
        ),
    )
    # The raw record is kept only where it is quarantined: a valid change's bytes would only weigh on the batch's
    # local checkpoint and on the ordering's shuffle. (A projection of its own: ``_error`` is computed once.)
    if keep_raw:
        return *staged, changes
    return *staged, changes, without_valid_raw


@lru_cache(maxsize=1)
def _raw_if_rejected() -> dict[str, Column]:
    rejected_only = F.col("_error").isNotNull()
    return {"_key": F.when(rejected_only, F.col("_key")), "_value": F.when(rejected_only, F.col("_value"))}


def without_valid_raw(changes_df: DataFrame) -> DataFrame:
    """A table's changes decoded with ``keep_raw``, as :func:`table_changes` gives them without: the raw record
    kept only where the change is rejected."""
    return changes_df.withColumns(_raw_if_rejected())


def stream_changes(raw_df: DataFrame, cfg: ReplicaConfig, schemas: dict[str, TableSchema]) -> DataFrame | None:
    """A one-table replica's decode as part of its streaming query: every record's change, raw record kept.

    Spark then analyses the decode once, when the query starts, and plans it before each batch, instead of the
    batch analysing each step of it again. The raw records stay for what decodes a batch again (a table's new
    schema, see :func:`records`) and for the changes held behind a quarantined record. None for a replica of
    several tables, whose batches decode the envelopes once for every table.
    """
    if len(cfg.tables) != 1:
        return None
    schema = schemas[cfg.tables[0].name]
    return table_changes(envelopes(raw_df, cfg, schemas), schema, unrouted=True, alone=True, keep_raw=True)


def records(changes_df: DataFrame) -> DataFrame:
    """The raw records of changes decoded with ``keep_raw`` from every record (:func:`stream_changes`), as the
    Kafka source gives them, to decode again."""
    return changes_df.select(*[F.col(name).alias(source) for source, name in _RAW_NAMES])


def _typed_key_and_data(present: frozenset[str], schema: TableSchema) -> tuple[Step, ...]:
    """The steps that add the key typed (``_k``), the row typed (``_d``), whether the key is plain or one JSON value
    (``_key_plain``, ``_key_single``) and the names of the row's mistyped columns (``_bad``), each computed once."""
    keys = list(schema.table.keys)
    key_text = F.col("_key").cast("string")
    data_struct = F.col("_d")
    data_strict = F.try_parse_json(F.col("_data_json"))
    # Each DECIMAL value's text, once: the checks read it several times, under conditions that keep Spark from
    # computing it once for them.
    decimals = [(i, f) for i, f in enumerate(schema.data.fields) if isinstance(f.dataType, T.DecimalType)]
    texts = {f.name: F.col(f"_decimal_{i}") for i, f in decimals}
    bad_columns = F.concat_ws(
        ", ",
        *[
            F.when(
                _mistyped(f, data_struct, data_strict, _connect(present, schema), schema.table.format, texts),
                _bad_column(f, _connect(present, schema), texts),
            )
            for f in schema.data.fields
        ],
    )
    # Which columns are mistyped: one more parse of the data, so only for the rows whose data did not parse, may hold
    # a value turned into a string, or hold a number too large for its column (1e400 reads as an infinite double).
    suspect = reduce(
        lambda a, b: a | b,
        [_looks_coerced(data_struct[f.name]) for f in schema.data.fields if isinstance(f.dataType, T.StringType)]
        + [_infinite(data_struct[f.name]) for f in schema.data.fields if _is_floating(f.dataType)]
        + [
            data_struct[f.name].isNull() & logical.wire(f.name).isNotNull()  # not converted by its logical type
            for f in schema.data.fields
            if logical.is_temporal_or_decimal(f.dataType)
            or (schema.table.format == "debezium" and isinstance(f.dataType, T.StringType))  # a time of day
        ]
        + [
            # a native DECIMAL's string
            data_struct[f.name].isNotNull() & _is_string(F.col(ROW), logical.member(f.name))
            for f in schema.data.fields
            if isinstance(f.dataType, T.DecimalType) and schema.table.format == "native"
        ]
        + [
            # a DECIMAL's number (or string of one) that Spark rounded to the column's scale
            data_struct[f.name].isNotNull() & _rounded(f.dataType, texts[f.name])
            for _, f in decimals
        ]
        + [
            data_struct[f.name].isNull() & logical.wire(f.name).isNotNull()  # elements not converted by their type
            for f in schema.data.fields
            if schema.table.format == "debezium" and logical.by_elements(f.dataType)
        ]
        + [
            _nested_mismatch(f.dataType, _member(F.col(ROW), f.name)) & ~_by_element_unit(f, _connect(present, schema))
            for f in schema.data.fields
            if _nests(f.dataType)
        ]
        + [
            (data_struct[f.name] < 0) & _nested_mismatch(f.dataType, _member(F.col(ROW), f.name))  # see _mistyped
            for f in schema.data.fields
            if isinstance(f.dataType, T.ByteType)
        ],
        data_struct["_corrupt"].isNotNull(),
    )
    return (
        _with("_k", _key(present, schema)),
        _with("_d", _data(present, schema)),
        *[_with(f"_decimal_{i}", _value_text(F.col(ROW), f.name)) for i, f in decimals],
        # Before the key's checks, so that Spark projects it with them, apart from the parses around them.
        _with("_bad", F.when((F.col("_op") == "upsert") & suspect, bad_columns)),
        _with("_key_plain", _plain_key(key_text, F.col("_k"), keys)),
        # Not ``plain | single``: Spark evaluates a subexpression used twice on both sides of an OR before the OR,
        # so every key was parsed strictly; a CASE evaluates its other branch only where the key is not plain.
        _with("_key_single", F.when(F.col("_key_plain"), F.lit(True)).otherwise(_single(key_text, _strict(key_text)))),
        _syntax_step(F.col("_key"), F.col("_key_single"), "_key_syntax"),
    )


def _debezium_dated_keys(schema: TableSchema) -> list[T.StructField]:
    """A Debezium table's DATE and TIMESTAMP key columns (read by the key's logical types, see :func:`_key`)."""
    if schema.table.format != "debezium":
        return []
    return [f for f in schema.key_schema.fields if logical.is_date_or_time(f.dataType)]


def _key(present: frozenset[str], schema: TableSchema) -> Column:
    """The key typed, from ``_key_json``. A Debezium key's DATE and TIMESTAMP columns are read as text and converted
    as a row's are (:func:`logical.from_text`): by the logical type the key's Connect schema gives them, else from
    a string of the column's form; a value neither gives is null (refused by :func:`_key_checks`)."""
    dated = _debezium_dated_keys(schema)
    if not dated:
        return F.from_json(F.col("_key_json"), _with_corrupt(schema.key_schema), _PERMISSIVE)
    fields = (
        F.col(logical.KEY_CONNECT_FIELDS)
        if logical.KEY_CONNECT_FIELDS in present
        else F.lit(None).cast(logical.FIELDS_TYPE)
    )
    return _by_logical_types(F.col("_key_json"), schema.key_schema, dated, fields)


def _by_logical_types(json: Column, struct: T.StructType, converted: Sequence[T.StructField], fields: Column) -> Column:
    """``json`` parsed as ``struct``, its ``converted`` fields read as text and converted by the logical types the
    Connect field schemas ``fields`` give them (:func:`logical.from_text`); ``_corrupt`` as a parse's."""
    as_text = T.StructType([T.StructField(f.name, T.StringType()) if f in converted else f for f in struct.fields])
    text = F.from_json(json, _with_corrupt(as_text), _PERMISSIVE)
    values = [
        (logical.from_text(f, text[f.name], fields) if f in converted else text[f.name]).alias(f.name)
        for f in struct.fields
    ]
    return F.struct(*values, text["_corrupt"].alias("_corrupt"))


def _key_checks(schema: TableSchema) -> list[tuple[Column, Column | str]]:
    """Why a change's key is not exactly one JSON object of the key columns, typed as declared (first reason first)."""
    keys = list(schema.table.keys)
    key_struct = F.col("_k")
    key_missing = reduce(lambda a, b: a | b, [key_struct[k].isNull() for k in keys])
    key_strict = F.try_parse_json(F.col("_key_json"))
    key_mistyped = reduce(
        lambda a, b: a | b,
        [
            _looks_coerced(key_struct[f.name]) & _not_string(key_strict, logical.member(f.name))
            for f in schema.key_schema.fields
            if isinstance(f.dataType, T.StringType)
        ]
        + [  # a native date or time not of its column's form, which Spark's parser reads anyway (a number, too)
            key_struct[f.name].isNotNull()
            & logical.malformed(f.dataType, F.get_json_object(F.col("_key_json"), logical.member(f.name)))
            for f in schema.key_schema.fields
            if logical.is_date_or_time(f.dataType) and schema.table.format == "native"
        ]
        + [  # a TINYINT of 128..255, which Jackson reads as -128..-1: two keys would be one
            (key_struct[f.name] < 0) & _nested_mismatch(f.dataType, _member(key_strict, f.name))
            for f in schema.key_schema.fields
            if isinstance(f.dataType, T.ByteType)
        ]
        + [  # a native DECIMAL Spark rounded to the column's scale: two keys would be one
            key_struct[f.name].isNotNull() & _rounded(f.dataType, _value_text(key_strict, f.name))
            for f in schema.key_schema.fields
            if isinstance(f.dataType, T.DecimalType) and schema.table.format == "native"
        ]
        + [  # a native DECIMAL's string that is not a number as JSON writes it: Spark drops commas, takes "+5"
            key_struct[f.name].isNotNull()
            & _is_string(key_strict, logical.member(f.name))
            & ~logical.is_number(_value_text(key_strict, f.name))
            for f in schema.key_schema.fields
            if isinstance(f.dataType, T.DecimalType) and schema.table.format == "native"
        ]
        + [  # a Debezium date or time that neither its logical type nor its form converts
            key_struct[f.name].isNull() & F.get_json_object(F.col("_key_json"), logical.member(f.name)).isNotNull()
            for f in _debezium_dated_keys(schema)
        ],
        key_struct["_corrupt"].isNotNull(),
    )
    key_names = F.json_object_keys(F.col("_key_json"))
    key_extra = F.array_except(key_names, F.array(*[F.lit(k) for k in keys]))
    not_key_object = f"key is not a JSON object of the key columns ({', '.join(keys)})"
    expected = ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in schema.key_schema.fields)
    return [
        *_text_checks(F.col("_key"), F.col("_key_single"), F.col("_key_syntax"), "key", not_key_object),
        ((key_struct.isNull() | key_struct["_corrupt"].isNotNull() | key_missing) & key_names.isNull(), not_key_object),
        (key_mistyped, f"key has a column of the wrong type (expected {expected})"),
        (key_missing, f"key lacks a key column ({', '.join(keys)})"),
        (
            ~F.col("_key_plain") & (F.size(key_extra) > 0),
            F.concat(
                F.lit("key has a field that is not a key column: "),
                F.array_join(key_extra, ", "),
                F.lit(f" (the key columns: {', '.join(keys)})"),
            ),
        ),
    ]


def _data_checks(schema: TableSchema) -> list[tuple[Column, Column | str]]:
    """Why an upsert's row does not match the table's schema or its key (first reason first)."""
    key_struct, data_struct = F.col("_k"), F.col("_d")
    is_upsert = F.col("_op") == "upsert"
    key_differs = reduce(lambda a, b: a | b, [~key_struct[k].eqNullSafe(data_struct[k]) for k in schema.table.keys])
    unsent: list[tuple[Column, Column | str]] = []
    if schema.table.format == "debezium":
        missing = logical.unavailable(schema.data.fields, data_struct)
        unsent.append(
            (
                is_upsert & (missing != ""),
                F.concat(
                    F.lit("Debezium sent no value for "),
                    missing,
                    F.lit(
                        f" ('{logical.UNAVAILABLE}': an unchanged TOASTed value; set REPLICA IDENTITY FULL on the "
                        "source table, see the README's Debezium settings)"
                    ),
                ),
            )
        )
    # A kept column declared NOT NULL: the replica table refuses a null there (the batch would fail on it). After
    # the type checks: a value of another type reads as null too, and is named as such.
    required = [f.name for f in schema.kept.fields if not f.nullable and f.name not in schema.table.keys]
    nulls = F.concat_ws(", ", *[F.when(data_struct[name].isNull(), F.lit(name)) for name in required])
    no_value = [(is_upsert & (nulls != ""), F.concat(F.lit("data has no value for NOT NULL column "), nulls))]
    return [
        *unsent,
        (F.col("_bad") != "", F.concat(F.lit("data does not match the table schema: "), F.col("_bad"))),
        (is_upsert & data_struct["_corrupt"].isNotNull(), "data is not a JSON object of the table's columns"),
        *(no_value if required else []),
        (is_upsert & key_differs, "the record key does not match the key columns in data"),
    ]


def _sequence(schema: TableSchema) -> Column:
    """A change's place in its key's order: none without ``sequence_by`` (the log position decides, whatever seq the
    record carries), else the row's ``sequence_by`` column if the row has it, else the envelope's. Null where the
    row's value is beyond BIGINT's range (a DECIMAL(p,0) column; see :func:`_sequence_overflows`)."""
    table = schema.table
    if table.sequence_by is None:  # the log position decides: a seq its records carry is not read
        return F.lit(None).cast("long")
    if table.sequence_by in schema.data.fieldNames():
        row_seq = F.col("_d")[table.sequence_by].try_cast("long")
        # A Debezium delete's row image is its `before`; a native delete carries no row, its envelope seq orders it.
        return (
            row_seq
            if table.format == "debezium"
            else F.when(F.col("_op") == "upsert", row_seq).otherwise(F.col("_seq"))
        )
    return F.col("_seq")


def _sequence_overflows(schema: TableSchema, seq: Column) -> Column:
    """Whether the row holds a ``sequence_by`` value that :func:`_sequence` (``seq``) could not read as a BIGINT."""
    table = schema.table
    if not (table.sequence_by and table.sequence_by in schema.data.fieldNames()):
        return F.lit(False)
    return F.col("_d")[table.sequence_by].isNotNull() & seq.isNull()


def _data(present: frozenset[str], schema: TableSchema) -> Column:
    """The row of a change, typed: parsed from ``_data_json``, unless the envelope's parse typed it already.

    A Debezium row's TIMESTAMP, DATE and DECIMAL columns are read as text and converted by the logical type the
    record's schema gives them (:mod:`replica_lib.logical`); a native row's are read as declared.
    """
    special = [f for f in schema.data.fields if logical.is_temporal_or_decimal(f.dataType)]
    connect = _connect(present, schema)
    # A Debezium STRING column may also hold a time of day, which arrives as a count in the unit of its logical type.
    # So may the elements of an ARRAY (PostgreSQL's ``date[]``, ``numeric[]``, ``time[]``).
    by_schema = [
        f
        for f in schema.data.fields
        if f in special or isinstance(f.dataType, T.StringType) or logical.by_elements(f.dataType)
    ]
    if connect is not None and by_schema:
        return _by_logical_types(F.col("_data_json"), schema.data, by_schema, connect)
    parsed = F.from_json(F.col("_data_json"), _with_corrupt(schema.data), _PERMISSIVE)
    name = typed_data_column(schema.table.name)
    typed = None
    if name in present:
        typed = F.col(f"`{name}`")
        fields = [typed[f.name].alias(f.name) for f in schema.data.fields]
        none = F.lit(None).cast("string").alias("_corrupt")
        parsed = F.when(typed.isNotNull(), F.struct(*fields, none)).otherwise(parsed)
    nested_decimals = [f for f in schema.data.fields if _nests(f.dataType) and _holds_decimals(f.dataType)]
    if not special and not nested_decimals:
        return parsed
    exact = F.col(ROW) if typed is None else F.when(typed.isNull(), F.col(ROW))
    values = [
        (
            _exact_decimal(f, parsed[f.name], exact)
            if isinstance(f.dataType, T.DecimalType) or f in nested_decimals
            else logical.converted(f, parsed[f.name])
            if f in special
            else parsed[f.name]
        ).alias(f.name)
        for f in schema.data.fields
    ]
    return F.struct(*values, parsed["_corrupt"].alias("_corrupt"))


def _holds_decimals(data_type: T.DataType) -> bool:
    """Whether an ARRAY, MAP or STRUCT type holds DECIMAL values, and only values that its strict parse (a variant)
    reads as ``from_json`` does: numbers, strings and booleans, at any depth (not dates, times or bytes)."""

    def leaves(t: T.DataType) -> list[T.DataType]:
        if isinstance(t, T.ArrayType):
            return leaves(t.elementType)
        if isinstance(t, T.MapType):
            return leaves(t.valueType)
        if isinstance(t, T.StructType):
            return [leaf for f in t.fields for leaf in leaves(f.dataType)]
        return [t]

    found = leaves(data_type)
    plain = all(isinstance(t, (T.NumericType, T.StringType, T.BooleanType)) for t in found)
    return plain and any(isinstance(t, T.DecimalType) for t in found)


def _exact_decimal(field: T.StructField, parsed: Column, row: Column) -> Column:
    """A row's DECIMAL value (or an ARRAY, MAP or STRUCT of them, :func:`_holds_decimals`): as the typed parse of
    the record read it, or else from ``row``, its strict parse.

    ``_data_json`` (the untyped parse's text) holds a number with a fraction or an exponent as a double writes it,
    with 17 digits (``1.00000000000000000001`` is ``1.0`` there); the strict parse keeps one of up to 38 digits
    without an exponent as sent. Where there is neither (no typed parse, no strict one), the parse of ``_data_json``.
    """
    exact = F.try_variant_get(row, logical.member(field.name), field.dataType.simpleString())
    return F.when(row.isNotNull(), exact).otherwise(parsed)


def _count(text: Column, char: str) -> Column:
    """How often the ASCII ``char`` occurs in ``text``: the pieces a split at it makes, less one.

    Java splits at one (escaped) character without a regular expression, in one pass of ``indexOf``; Spark's
    ``replace`` calls a comparison at every byte (three counts by ``replace`` took 1.6 times as long).
    """
    return F.size(F.split(text, re.escape(char))) - 1


def _plain_key(key_text: Column, key_struct: Column, columns: Sequence[str]) -> Column:
    """Whether a key is, without a second parse, exactly one strict JSON object of just the key columns.

    Its typed parse took it (strict syntax, every key column present), and its text has one ``{``, one ``}`` as its
    last non-blank character and one ``:`` per key column: so it has no other field, no field twice, nothing nested
    and nothing after the object. Any other key (a string value with a colon or a brace, too) takes the full checks.
    """
    present = reduce(lambda a, b: a & b, [key_struct[c].isNotNull() for c in columns])
    after = F.substring_index(key_text, "}", -1)  # what follows the one "}"
    plain = (
        F.is_valid_utf8(key_text)
        & key_struct["_corrupt"].isNull()
        & present
        & (_count(key_text, ":") == len(columns))
        & (_count(key_text, "{") == 1)
        & (_count(key_text, "}") == 1)
        & (F.octet_length(F.translate(after, " \t\n\r", "")) == 0)
        & _no_unpaired_surrogate(key_text)
    )
    return F.coalesce(plain, F.lit(False))


def _connect(present: frozenset[str], schema: TableSchema) -> Column | None:
    """A Debezium table's column of the records' field schemas (:data:`logical.CONNECT_FIELDS`), else None."""
    if schema.table.format == "debezium" and logical.CONNECT_FIELDS in present:
        return F.col(logical.CONNECT_FIELDS)
    return None


#: What a DATE, TIMESTAMP and TIMESTAMP_NTZ column's text looks like, for the reason that refuses another.
_TEMPORAL_EXAMPLES: dict[type[T.DataType], str] = {
    T.DateType: "2024-05-06",
    T.TimestampType: "2024-05-06T10:15:30.123456Z",
    T.TimestampNTZType: "2024-05-06T10:15:30.123456",
}


def _bad_column(field: T.StructField, connect: Column | None, texts: dict[str, Column]) -> Column:
    """How a mistyped column is named in the reason: its type, and for a number or a string not of the column's form
    in a TIMESTAMP or DATE column that no schema gives a unit, or a number a DECIMAL column would round, why."""
    kind = field.dataType.simpleString()
    plain = F.lit(f"{field.name} ({kind})")
    if isinstance(field.dataType, T.DecimalType):
        rounded = _rounded(field.dataType, texts[field.name])
        return F.when(rounded, F.lit(f"{field.name} ({kind}, {logical.BEYOND_SCALE})")).otherwise(plain)
    if not logical.is_date_or_time(field.dataType):
        return plain
    example = _TEMPORAL_EXAMPLES[type(field.dataType)]
    how = (
        "a number with no unit: send Debezium's schema with it (value.converter.schemas.enable=true)"
        if connect is not None
        else f"a number with no unit: send a string such as {example}"
    )
    text = logical.wire(field.name)
    unit_less = logical.is_number(text)
    malformed = logical.malformed(field.dataType, text)
    if connect is not None:
        no_schema = logical.field_schema(field.name, connect)["name"].isNull()
        unit_less, malformed = unit_less & no_schema, malformed & no_schema
    form = f"not of the form {example}: see the contract's dates and times"
    return (
        F.when(unit_less, F.lit(f"{field.name} ({kind}, {how})"))
        .when(malformed, F.lit(f"{field.name} ({kind}, {form})"))
        .otherwise(plain)
    )


def _is_floating(data_type: T.DataType) -> bool:
    return isinstance(data_type, (T.DoubleType, T.FloatType))


def _infinite(value: Column) -> Column:
    return value.isin(float("inf"), float("-inf"))


def _mistyped(
    field: T.StructField,
    data_struct: Column,
    data_strict: Column,
    connect: Column | None,
    data_format: str,
    texts: dict[str, Column],
) -> Column:
    """Whether the data's value for ``field`` does not have the column's type (Spark read it as null, turned a
    non-string into a STRING other than a time of day its schema gives a unit, overflowed a floating column to
    infinity, read into a native row's DECIMAL a string that is not a number as JSON writes it, rounded a number into
    a DECIMAL, read 128..255 into a TINYINT, or took a nested value the contract refuses)."""
    value = data_struct[field.name]
    present = F.get_json_object(F.col("_data_json"), logical.member(field.name)).isNotNull()
    if isinstance(field.dataType, T.DecimalType):
        rounded = value.isNotNull() & _rounded(field.dataType, texts[field.name])
        if data_format != "native":
            return (present & value.isNull()) | rounded
        text = logical.wire(field.name)
        as_string = value.isNotNull() & _is_string(data_strict, logical.member(field.name)) & ~logical.is_number(text)
        return (present & value.isNull()) | as_string | rounded
    if isinstance(field.dataType, T.StringType):
        coerced = _looks_coerced(value) & _not_string(data_strict, logical.member(field.name))
        if connect is not None:
            coerced = coerced & ~logical.is_time(field.name, connect)
        return (present & value.isNull()) | coerced
    if _is_floating(field.dataType):
        return (present & value.isNull()) | _infinite(value)
    if _nests(field.dataType):
        nested = _nested_mismatch(field.dataType, _member(data_strict, field.name)) & ~_by_element_unit(field, connect)
        return (present & value.isNull()) | nested
    if isinstance(field.dataType, T.ByteType):  # Jackson reads 128..255 as -128..-1: the JSON value tells
        return (present & value.isNull()) | _nested_mismatch(field.dataType, _member(data_strict, field.name))
    return present & value.isNull()


def _by_element_unit(field: T.StructField, connect: Column | None) -> Column:
    """Whether a Debezium record's schema gives the elements of ARRAY column ``field`` a logical type, by which they
    were converted (each exactly, or the value refused) rather than read as the contract's JSON values."""
    if connect is None or not logical.by_elements(field.dataType):
        return F.lit(False)
    return logical.has_element_unit(field.name, connect)


def _rounded(data_type: T.DataType, text: Column) -> Column:
    """Whether ``text``, a value's text, is a number (or a string of one) that Spark rounds into a DECIMAL of
    ``data_type``'s scale."""
    assert isinstance(data_type, T.DecimalType)
    return logical.is_number(text) & logical.beyond_scale(text, data_type.scale)


def _value_text(strict: Column, name: str) -> Column:
    """The text of field ``name`` of ``strict`` (a JSON object, a variant: a number as sent, unlike ``_data_json``,
    up to 38 digits without an exponent)."""
    return F.try_variant_get(strict, logical.member(name), "string")


#: The largest magnitude a JSON number may have to be read into a FLOAT: 2^128 - 2^103, from which Java's float
#: parsing rounds to infinity.
_FLOAT_LIMIT = 3.4028235677973366e38


def _nested_mismatch(data_type: T.DataType, value: Column) -> Column:
    """Whether ``value``, the JSON value (a variant) of a column of ``data_type`` or of a value nested in one, holds
    a value the contract refuses at any depth; false where it is absent or null.

    The contract's types hold inside ARRAY, MAP and STRUCT columns as at the top, but Spark's reader does not check
    them there: it turns a number into a STRING, reads ``"20240506"`` into a DATE as the year 57386 and a time of
    day into a TIMESTAMP of the day it runs, overflows a FLOAT to infinity. So each value is checked by the kind of
    JSON value it is (:func:`pyspark.sql.functions.schema_of_variant`). Where the shape differs (an object for an
    ARRAY), Spark's reader refuses the value itself.
    """
    kind = F.schema_of_variant(value)
    number = (kind == "BIGINT") | (kind == "DOUBLE") | F.startswith(kind, F.lit("DECIMAL"))
    text = F.try_variant_get(value, "$", "string")
    bad: Column
    if isinstance(data_type, T.ArrayType):
        elements = F.try_variant_get(value, "$", "array<variant>")
        bad = F.exists(elements, lambda element: _nested_mismatch(data_type.elementType, element))
    elif isinstance(data_type, T.MapType):
        entries = F.map_values(F.try_variant_get(value, "$", "map<string,variant>"))
        bad = F.exists(entries, lambda entry: _nested_mismatch(data_type.valueType, entry))
    elif isinstance(data_type, T.StructType):
        fields = [_nested_mismatch(f.dataType, _member(value, f.name)) for f in data_type]
        bad = reduce(lambda a, b: a | b, fields, F.lit(False))
    elif isinstance(data_type, (T.StringType, T.BinaryType)):
        bad = kind != "STRING"
    elif isinstance(data_type, T.BooleanType):
        bad = kind != "BOOLEAN"
    elif isinstance(data_type, T.IntegralType):  # a JSON integer in the type's range (1.0 is a DECIMAL here)
        bad = (kind != "BIGINT") | F.try_variant_get(value, "$", data_type.simpleString()).isNull()
    elif isinstance(data_type, T.FloatType):
        bad = ~number | (F.abs(F.try_variant_get(value, "$", "double")) >= _FLOAT_LIMIT)
    elif isinstance(data_type, T.DoubleType):
        bad = ~number | _infinite(F.try_variant_get(value, "$", "double"))
    elif isinstance(data_type, T.DecimalType):
        bad = (~number & ((kind != "STRING") | ~logical.is_number(text))) | logical.beyond_scale(text, data_type.scale)
    elif logical.is_date_or_time(data_type):
        bad = (kind != "STRING") | logical.malformed(data_type, text)
    else:
        bad = F.lit(False)
    return F.coalesce(~value.isNull() & (kind != "VOID") & bad, F.lit(False))


def _member(value: Column, name: str) -> Column:
    """The value of field ``name`` of a JSON object (a variant), or null."""
    return F.try_variant_get(value, logical.member(name), "variant")


def _nests(data_type: T.DataType) -> bool:
    return isinstance(data_type, (T.ArrayType, T.MapType, T.StructType))


def _with_corrupt(schema: T.StructType) -> T.StructType:
    return T.StructType([*schema.fields, T.StructField("_corrupt", T.StringType())])


def valid(df: DataFrame) -> DataFrame:
    return df.where(F.col("_error").isNull())


def rejected(df: DataFrame) -> DataFrame:
    return df.where(F.col("_error").isNotNull())
