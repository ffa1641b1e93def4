"""Configuration, validated once into frozen dataclasses. The only module that reads files or environment.

A replica is one TOML file in ``conf/``::

    [replica]
    name = "orders_a"                       # names the query, the consumer identity and the app id
    checkpoint = "${REPLICA_DATA_DIR}/orders_a/_checkpoint"
    quarantine = { path = "${REPLICA_DATA_DIR}/orders_a/_quarantine" }
    tombstone_retention = "7 days"          # optional: how long a delete is kept at least (see maintenance)

    [kafka]
    bootstrap_servers = "${REPLICA_BOOTSTRAP_SERVERS}"
    options = { "security.protocol" = "SASL_SSL", "sasl.jaas.config" = "${ORDERS_JAAS}" }

    [source]        # optional
    starting_offsets = "earliest"           # or "latest", or Spark's JSON per partition
    max_offsets_per_trigger = 100000
    fail_on_data_loss = true

    [trigger]       # optional
    available_now = false
    interval = "5 seconds"

    [tables.orders]
    topic = "orders"
    format = "native"                       # or "debezium"
    keys = ["order_id"]
    sequence_by = "seq"                     # optional
    schema = "order_id BIGINT, customer STRING, amount DOUBLE, status STRING"
    target = { path = "${REPLICA_STATE_DIR}/warehouse/orders_a/orders" }   # or { table = "db.orders" }

``${VAR}`` and ``${VAR:-default}`` take values from the environment, so secrets stay out of files
(``REPLICA_DATA_DIR`` defaults to ``<state>/data``, where the example replicas keep tables); values of
secret-looking Kafka options are never printed (see :meth:`KafkaConfig.redacted`). Unknown keys are errors.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replica_lib.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What Spark's processingTime trigger parses: a whole number of milliseconds/seconds/minutes/hours (only
# seconds may have a fraction); Spark rejects abbreviations such as "5s" or "500 ms" when the query starts.
_RETENTION = re.compile(r"^(\d+)\s+(seconds?|minutes?|hours?|days?)$", re.I)
_UNIT_S = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
_INTERVAL = re.compile(r"^(\d+\s+(milliseconds?|seconds?|minutes?|hours?)|\d+\.\d+\s+seconds?)$", re.I)
_SECRET_HINTS = ("password", "secret", "jaas", "token", "key")
FORMATS = ("native", "debezium")


# ---------------------------------------------------------------------------------------------- local settings
@dataclass(frozen=True)
class LocalSettings:
    """Where this checkout keeps its state (venv, jar cache, embedded broker, demo warehouse) and its Java."""

    state_dir: Path
    java_home: str | None

    @property
    def broker_dir(self) -> Path:
        return self.state_dir / "broker"


def local_settings(environ: Mapping[str, str] | None = None) -> LocalSettings:
    """Settings for local use: ``REPLICA_STATE_DIR`` (default ``<project>/.state``) and ``JAVA_HOME``."""
    env = os.environ if environ is None else environ
    state = Path(env.get("REPLICA_STATE_DIR") or PROJECT_ROOT / ".state").resolve()
    return LocalSettings(state_dir=state, java_home=env.get("JAVA_HOME") or None)


# ---------------------------------------------------------------------------------------------- replica config
@dataclass(frozen=True)
class KafkaConfig:
    """How to reach the cluster; ``options`` pass through to Spark as ``kafka.<key>``."""

    bootstrap_servers: str
    options: tuple[tuple[str, str], ...] = ()

    def spark_options(self) -> dict[str, str]:
        opts = {f"kafka.{key}": value for key, value in self.options}
        opts["kafka.bootstrap.servers"] = self.bootstrap_servers
        return opts

    def client_config(self) -> dict[str, str]:
        """The same connection for confluent-kafka clients (librdkafka property names)."""
        return {"bootstrap.servers": self.bootstrap_servers, **dict(self.options)}

    def redacted(self) -> dict[str, str]:
        """The options with secret-looking values masked, safe to log."""
        return {
            key: ("***" if any(hint in key.lower() for hint in _SECRET_HINTS) else value) for key, value in self.options
        }

    def __repr__(self) -> str:
        return f"KafkaConfig(bootstrap_servers={self.bootstrap_servers!r}, options={self.redacted()!r})"


@dataclass(frozen=True)
class Target:
    """A Delta table, by path or by catalog name."""

    path: str | None = None
    table: str | None = None

    def describe(self) -> str:
        return self.table if self.table else f"delta.`{self.path}`"


@dataclass(frozen=True)
class TableConfig:
    """One replicated table: which topic feeds it and how its rows are keyed, ordered and typed."""

    name: str
    topic: str
    keys: tuple[str, ...]
    schema: str
    target: Target
    format: str = "native"
    sequence_by: str | None = None
    include_columns: tuple[str, ...] = ()
    exclude_columns: tuple[str, ...] = ()


@dataclass(frozen=True)
class SourceConfig:
    starting_offsets: str = "earliest"
    max_offsets_per_trigger: int | None = None
    fail_on_data_loss: bool = True


@dataclass(frozen=True)
class TriggerConfig:
    available_now: bool = False
    interval: str = "5 seconds"


@dataclass(frozen=True)
class CompactionConfig:
    """The replica packing the small files its batches leave in its tables (a Delta OPTIMIZE between batches)."""

    every_batches: int = 50  # after every this-many-th batch (by batch id, across restarts); 0 = never
    small_file_mb: int = 16  # files smaller than this are packed together (larger ones are left as they are)


@dataclass(frozen=True)
class ReplicaConfig:
    """A whole replica: one streaming query, its checkpoint, its tables."""

    name: str
    source_file: str
    kafka: KafkaConfig
    checkpoint: str
    quarantine: Target
    tables: tuple[TableConfig, ...]
    source: SourceConfig = field(default_factory=SourceConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    tombstone_retention_s: int = 7 * 86400
    compaction: CompactionConfig = field(default_factory=CompactionConfig)

    @property
    def topics(self) -> tuple[str, ...]:
        return tuple(sorted({table.topic for table in self.tables}))

    def table(self, name: str) -> TableConfig:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------- loading
class _Reader:
    """Walks one parsed TOML document, expanding ``${VAR}`` and rejecting unknown keys."""

    def __init__(self, source: str, environ: Mapping[str, str]) -> None:
        self.source = source
        self.environ = environ

    def fail(self, key: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(self.source, key, problem, fix)

    def section(self, data: Mapping[str, Any], key: str, allowed: set[str], required: bool) -> dict[str, Any]:
        value = data.get(key)
        if value is None:
            if required:
                raise self.fail(key, "missing section", f"add a [{key}] section")
            return {}
        if not isinstance(value, dict):
            raise self.fail(key, "must be a table", f"write it as [{key}] with keys {sorted(allowed)}")
        self.only(value, key, allowed)
        return value

    def only(self, value: Mapping[str, Any], where: str, allowed: set[str]) -> None:
        for key in value:
            if key not in allowed:
                raise self.fail(
                    f"{where}.{key}" if where else key,
                    "unknown key",
                    f"remove it; allowed keys here: {', '.join(sorted(allowed))}",
                )

    def expand(self, key: str, text: str) -> str:
        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in self.environ and self.environ[name] != "":
                return self.environ[name]
            if default is not None:
                return default
            raise self.fail(key, f"environment variable {name} is not set", f"export {name}=... before running")

        return _VAR.sub(substitute, text)

    def string(self, data: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
        value = data.get(key, default)
        if value is None:
            raise self.fail(f"{where}.{key}", "missing", f'set {key} = "..." in [{where}]')
        if not isinstance(value, str) or not value.strip():
            raise self.fail(f"{where}.{key}", f"must be a non-empty string, got {value!r}", 'quote it: "..."')
        return self.expand(f"{where}.{key}", value)

    def optional_string(self, data: Mapping[str, Any], key: str, where: str) -> str | None:
        return self.string(data, key, where) if key in data else None

    def names(self, data: Mapping[str, Any], key: str, where: str, required: bool) -> tuple[str, ...]:
        value = data.get(key, [] if not required else None)
        if value is None:
            raise self.fail(f"{where}.{key}", "missing", f'set {key} = ["col", ...]')
        if not isinstance(value, list) or not all(isinstance(v, str) and _NAME.match(v) for v in value):
            raise self.fail(f"{where}.{key}", f"must be a list of column names, got {value!r}", '["col", ...]')
        if required and not value:
            raise self.fail(f"{where}.{key}", "must not be empty", "name at least one key column")
        return tuple(value)

    def boolean(self, data: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
        value = data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(f"{where}.{key}", f"must be true or false, got {value!r}", "write true or false")
        return value

    def integer(self, data: Mapping[str, Any], key: str, where: str, default: int, minimum: int, example: str) -> int:
        value = data.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(f"{where}.{key}", f"must be an integer of at least {minimum}, got {value!r}", example)
        return value

    def target(self, value: Any, where: str) -> Target:
        if not isinstance(value, dict):
            raise self.fail(where, "must be a table", '{ path = "..." } or { table = "db.name" }')
        self.only(value, where, {"path", "table"})
        path = self.optional_string(value, "path", where)
        table = self.optional_string(value, "table", where)
        if (path is None) == (table is None):
            raise self.fail(where, "needs exactly one of path or table", '{ path = "..." } or { table = "db.t" }')
        return Target(path=path, table=table)


def load_replica(path: str | Path, environ: Mapping[str, str] | None = None) -> ReplicaConfig:
    """Read and validate one replica file; raises :class:`ConfigError` naming the file, key and fix."""
    source = str(path)
    env = dict(os.environ if environ is None else environ)
    env.setdefault("REPLICA_DATA_DIR", str(local_settings(env).state_dir / "data"))
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(source, "(file)", f"cannot read it ({exc.strerror})", "pass an existing file") from exc
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "(syntax)", str(exc), "fix the TOML syntax at that line") from exc
    return parse_replica(doc, source, env)


def parse_replica(doc: Mapping[str, Any], source: str, environ: Mapping[str, str]) -> ReplicaConfig:
    """Validate an already-parsed replica document."""
    r = _Reader(source, environ)
    r.only(doc, "", {"replica", "kafka", "source", "trigger", "compaction", "tables"})
    rep = r.section(doc, "replica", {"name", "checkpoint", "quarantine", "tombstone_retention"}, required=True)
    name = r.string(rep, "name", "replica")
    if not _NAME.match(name):
        raise r.fail("replica.name", f"{name!r} is not a plain name", "use letters, digits and _ only")
    if "quarantine" not in rep:
        raise r.fail("replica.quarantine", "missing", 'set quarantine = { path = "..." }')
    checkpoint = r.string(rep, "checkpoint", "replica")
    quarantine = r.target(rep["quarantine"], "replica.quarantine")
    retention = r.string(rep, "tombstone_retention", "replica", "7 days")
    retention_match = _RETENTION.match(retention.strip())
    if not retention_match:
        raise r.fail(
            "replica.tombstone_retention",
            f"{retention!r} is not a duration",
            'e.g. tombstone_retention = "7 days" (seconds, minutes, hours or days)',
        )
    unit = retention_match.group(2).lower().rstrip("s")
    tombstone_retention_s = int(retention_match.group(1)) * _UNIT_S[unit]

    kaf = r.section(doc, "kafka", {"bootstrap_servers", "options"}, required=True)
    options = kaf.get("options", {})
    if not isinstance(options, dict) or not all(isinstance(v, str) for v in options.values()):
        raise r.fail("kafka.options", "must map option names to strings", '{ "security.protocol" = "SSL" }')
    for key in options:
        if key == "bootstrap.servers":
            raise r.fail("kafka.options.bootstrap.servers", "set twice", "use kafka.bootstrap_servers only")
    kafka = KafkaConfig(
        bootstrap_servers=r.string(kaf, "bootstrap_servers", "kafka"),
        options=tuple(sorted((k, r.expand(f"kafka.options.{k}", v)) for k, v in options.items())),
    )

    src = r.section(doc, "source", {"starting_offsets", "max_offsets_per_trigger", "fail_on_data_loss"}, False)
    max_offsets = src.get("max_offsets_per_trigger")
    if max_offsets is not None and (
        not isinstance(max_offsets, int) or isinstance(max_offsets, bool) or max_offsets <= 0
    ):
        raise r.fail(
            "source.max_offsets_per_trigger",
            f"must be a positive integer, got {max_offsets!r}",
            "e.g. max_offsets_per_trigger = 100000",
        )
    starting_offsets = r.string(src, "starting_offsets", "source", "earliest")
    if starting_offsets.strip().lower() not in ("earliest", "latest") and not _json_object(starting_offsets):
        raise r.fail(
            "source.starting_offsets",
            f"{starting_offsets!r} is not earliest, latest or a JSON object",
            """e.g. "earliest", or per partition '{"orders": {"0": 42, "1": -2}}'""",
        )
    source_cfg = SourceConfig(
        starting_offsets=starting_offsets,
        max_offsets_per_trigger=max_offsets,
        fail_on_data_loss=r.boolean(src, "fail_on_data_loss", "source", True),
    )

    trig = r.section(doc, "trigger", {"available_now", "interval"}, required=False)
    interval = r.string(trig, "interval", "trigger", "5 seconds")
    if not _INTERVAL.match(interval.strip()):
        raise r.fail(
            "trigger.interval",
            f"{interval!r} is not a Spark duration",
            'e.g. "10 seconds" (units: milliseconds, seconds, minutes or hours)',
        )
    trigger = TriggerConfig(available_now=r.boolean(trig, "available_now", "trigger", False), interval=interval)

    comp = r.section(doc, "compaction", {"every_batches", "small_file_mb"}, required=False)
    compaction = CompactionConfig(
        every_batches=r.integer(
            comp, "every_batches", "compaction", 50, 0, "e.g. every_batches = 50 (0 turns the replica's compaction off)"
        ),
        small_file_mb=r.integer(comp, "small_file_mb", "compaction", 16, 1, "e.g. small_file_mb = 16"),
    )

    tables_doc = doc.get("tables")
    if not isinstance(tables_doc, dict) or not tables_doc:
        raise r.fail("tables", "no tables", "add at least one [tables.<name>] section")
    tables = tuple(_parse_table(r, tname, tdoc) for tname, tdoc in tables_doc.items())
    return ReplicaConfig(
        name=name,
        source_file=source,
        kafka=kafka,
        tables=tables,
        source=source_cfg,
        trigger=trigger,
        checkpoint=checkpoint,
        quarantine=quarantine,
        tombstone_retention_s=tombstone_retention_s,
        compaction=compaction,
    )


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _parse_table(r: _Reader, name: str, doc: Any) -> TableConfig:
    where = f"tables.{name}"
    if not _NAME.match(name):
        raise r.fail(where, f"{name!r} is not a plain name", "use letters, digits and _ only")
    if not isinstance(doc, dict):
        raise r.fail(where, "must be a table", f"write it as [{where}]")
    allowed = {"topic", "format", "keys", "sequence_by", "schema", "target", "include_columns", "exclude_columns"}
    r.only(doc, where, allowed)
    fmt = r.string(doc, "format", where, "native")
    if fmt not in FORMATS:
        raise r.fail(f"{where}.format", f"unknown format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    if "target" not in doc:
        raise r.fail(f"{where}.target", "missing", 'set target = { path = "..." } or { table = "db.t" }')
    table = TableConfig(
        name=name,
        topic=r.string(doc, "topic", where),
        format=fmt,
        keys=r.names(doc, "keys", where, required=True),
        sequence_by=r.optional_string(doc, "sequence_by", where),
        schema=r.string(doc, "schema", where),
        target=r.target(doc["target"], f"{where}.target"),
        include_columns=r.names(doc, "include_columns", where, required=False),
        exclude_columns=r.names(doc, "exclude_columns", where, required=False),
    )
    if table.include_columns and table.exclude_columns:
        raise r.fail(where, "both include_columns and exclude_columns are set", "keep only one of them")
    return table
