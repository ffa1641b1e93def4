"""Configuration, validated once into frozen dataclasses. The only module that reads files or environment.

A replica is one TOML file in ``conf/``::

    [replica]
    name = "orders_a"                       # names the query, the consumer identity and the app id
    checkpoint = "${REPLICA_DATA_DIR}/orders_a/_checkpoint"
    quarantine = { path = "${REPLICA_DATA_DIR}/orders_a/_quarantine" }
    tombstone_retention = "7 days"          # optional: how long a delete is kept at least (see maintenance)

    [kafka]
    bootstrap_servers = "${REPLICA_BOOTSTRAP_SERVERS}"

    [kafka.options]                         # optional: Kafka client options, in Java's or librdkafka's names
    "security.protocol"="SASL_SSL"
    "sasl.mechanism"="PLAIN"
    "sasl.jaas.config"='org.apache.kafka.common.security.plain.PlainLoginModule required username="u" password="${PW}";'

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
    layout = "copy-on-write"                # optional; or "merge-on-read" (with fold_every_batches = 10)
    deletion_vectors = true                 # optional; false: a table every Delta reader opens (see README)

``${VAR}`` and ``${VAR:-default}`` take values from the environment, so secrets stay out of files
(``REPLICA_DATA_DIR`` defaults to ``<state>/data``, where the example replicas keep tables); values of
secret-looking Kafka options are never printed (see :meth:`KafkaConfig.redacted`). Unknown keys are errors.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
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
#: How a table keeps its state (``layout``): every batch MERGEd into the table, or appended to a change log that
#: a fold MERGEs into the table now and then, with a view that always shows the state (replica_lib.layout).
COPY_ON_WRITE, MERGE_ON_READ = "copy-on-write", "merge-on-read"
LAYOUTS = (COPY_ON_WRITE, MERGE_ON_READ)
#: A table's answer to a field its schema does not declare (``TableConfig.schema_evolution``).
ADD_COLUMNS, STRICT = "add_columns", "strict"
SCHEMA_EVOLUTIONS = (ADD_COLUMNS, STRICT)
#: What a quarantined record does to the later records of its key (``TableConfig.on_poison``).
HOLD_KEY, SKIP = "hold_key", "skip"
ON_POISON = (HOLD_KEY, SKIP)


# ---------------------------------------------------------------------------------------------- local settings
@dataclass(frozen=True)
class LocalSettings:
    """Where this checkout keeps its state (venv, jar cache, embedded broker, demo warehouse) and its Java."""

    state_dir: Path
    java_home: str | None
    debug: bool = False  # show the trace of a failure, not only its one line
    #: Where the local catalog lives (``metastore``, ``warehouse``, the SQL server's file, pending registrations):
    #: ``REPLICA_CATALOG_DIR``, by default the state folder. See :mod:`replica_lib.catalog`.
    catalog_dir: Path | None = None

    @property
    def broker_dir(self) -> Path:
        return self.state_dir / "broker"

    @property
    def class_archive_dir(self) -> Path:
        """Where spark-submit.sh keeps the class-data archive (``replica_class_archive`` in scripts/bootstrap.sh)."""
        return self.state_dir / "class-archive"

    @property
    def catalog_home(self) -> Path:
        return self.catalog_dir or self.state_dir


def local_settings(environ: Mapping[str, str] | None = None) -> LocalSettings:
    """Settings for local use: ``REPLICA_STATE_DIR`` (default ``<project>/.state``), ``JAVA_HOME``,
    ``REPLICA_DEBUG`` (any value but empty or ``0``) and ``REPLICA_CATALOG_DIR`` (default: the state folder)."""
    env = os.environ if environ is None else environ
    state = Path(env.get("REPLICA_STATE_DIR") or PROJECT_ROOT / ".state").resolve()
    debug = env.get("REPLICA_DEBUG", "") not in ("", "0")
    catalog = Path(env["REPLICA_CATALOG_DIR"]).resolve() if env.get("REPLICA_CATALOG_DIR") else None
    return LocalSettings(state_dir=state, java_home=env.get("JAVA_HOME") or None, debug=debug, catalog_dir=catalog)


# ---------------------------------------------------------------------------------------------- replica config
@dataclass(frozen=True)
class ClientConfig:
    """The connection as confluent-kafka (librdkafka) clients make it, or why they cannot.

    ``settings`` is None when an option that the connection needs has no librdkafka equivalent (a JKS store, a
    Kerberos or OAuth login): the checks that use those clients then skip themselves, saying ``reason`` (which
    names the option), and Spark's Java client, which reads the option itself, is the only one to connect.
    """

    settings: Mapping[str, str] | None
    reason: str = ""

    def __repr__(self) -> str:
        shown = None if self.settings is None else _redact(self.settings)
        return f"ClientConfig(settings={shown!r}, reason={self.reason!r})"


#: librdkafka's own names for security options: the pre-check clients take them as they are.
_LIBRDKAFKA_ONLY = (
    "sasl.username",
    "sasl.password",
    "sasl.mechanisms",
    "ssl.ca.location",
    "ssl.ca.pem",
    "ssl.certificate.location",
    "ssl.certificate.pem",
    "ssl.key.location",
    "ssl.key.pem",
    "ssl.crl.location",
    "enable.ssl.certificate.verification",
)
#: Security options with the same name and meaning in both clients.
_SHARED = ("security.protocol", "sasl.kerberos.service.name", "ssl.key.password")
#: Java options that change how the client logs in; librdkafka has nothing like them.
_JAVA_ONLY_LOGIN = ("sasl.login.class", "sasl.login.callback.handler.class", "sasl.client.callback.handler.class")
#: Kafka's user-and-password login modules (by class name, so shaded copies count) and their usual mechanism.
_PASSWORD_MODULES = {"PlainLoginModule": "PLAIN", "ScramLoginModule": "SCRAM-SHA-512"}
_JAAS_ENTRY = re.compile(
    r"^\s*(?P<module>[A-Za-z_$][\w$]*(?:\.[A-Za-z_$][\w$]*)*)\s+(?P<flag>required|requisite|sufficient|optional)"
    r'(?P<options>(?:\s+[A-Za-z_$][\w.$-]*\s*=\s*(?:"(?:[^"\\]|\\.)*"|[^\s";=]+))*)\s*;\s*$',
    re.S,
)
_JAAS_OPTION = re.compile(r'([A-Za-z_$][\w.$-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s";=]+))', re.S)


@dataclass(frozen=True)
class JaasEntry:
    """One JAAS login module entry of ``sasl.jaas.config``, as Kafka's Java client reads it."""

    module: str
    options: Mapping[str, str]

    @property
    def password_login(self) -> str | None:
        """PLAIN or SCRAM-SHA-512 for a user-and-password module (Kafka's plain or SCRAM), else None."""
        return _PASSWORD_MODULES.get(self.module.rsplit(".", 1)[-1])

    def __repr__(self) -> str:
        return f"JaasEntry(module={self.module!r}, options={_redact(self.options)!r})"


def parse_jaas(text: str) -> JaasEntry | None:
    """Parse one ``<LoginModule> <flag> key="value" ...;`` entry (what a Kafka client accepts), or None."""
    match = _JAAS_ENTRY.match(text)
    if match is None:
        return None
    options = {
        key: re.sub(r"\\(.)", r"\1", quoted) if bare == "" else bare
        for key, quoted, bare in _JAAS_OPTION.findall(match.group("options"))
    }
    return JaasEntry(module=match.group("module"), options=options)


def _jaas_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: Spark's Kafka reader asks the broker for a partition's offset range after every poll, while the consumer's next
#: fetch, sent as the poll returned, waits there. A broker answers a connection's requests in order and holds a fetch
#: that finds nothing new for ``fetch.max.wait.ms`` (500 ms by default), so every task that reads up to the log's end
#: (each batch of a replica that keeps up) waited half a second for nothing. Spark's consumers poll only inside a
#: task, where that long poll saves nothing. A replica's own ``fetch.max.wait.ms`` option stands.
FETCH_MAX_WAIT_MS = 10


@dataclass(frozen=True)
class KafkaConfig:
    """How to reach the cluster; ``options`` pass through to Spark as ``kafka.<key>``.

    Security options may be written for Spark's Java client (``sasl.jaas.config``, ``sasl.mechanism``,
    ``ssl.truststore.*``, ``ssl.keystore.*``) or for librdkafka (``sasl.username``, ``sasl.password``,
    ``sasl.mechanisms``, ``ssl.ca.location``): each client gets them in its own names (:meth:`spark_options`,
    :meth:`client_config`).
    """

    bootstrap_servers: str
    options: tuple[tuple[str, str], ...] = ()

    def spark_options(self) -> dict[str, str]:
        """Options for Spark's kafka source; a login or CA given in librdkafka's names is given in Java's."""
        java = dict(self.options)
        if "sasl.mechanisms" in java:
            java.setdefault("sasl.mechanism", java.pop("sasl.mechanisms"))
        if "sasl.jaas.config" not in java and "sasl.username" in java and "sasl.password" in java:
            scram = java.get("sasl.mechanism", "").upper().startswith("SCRAM")
            module = "scram.ScramLoginModule" if scram else "plain.PlainLoginModule"
            user, password = _jaas_quote(java.pop("sasl.username")), _jaas_quote(java.pop("sasl.password"))
            java["sasl.jaas.config"] = (
                f"org.apache.kafka.common.security.{module} required username={user} password={password};"
            )
        if "ssl.ca.location" in java and "ssl.truststore.location" not in java:
            java.update({"ssl.truststore.type": "PEM", "ssl.truststore.location": java.pop("ssl.ca.location")})
        opts = {f"kafka.{key}": value for key, value in sorted(java.items())}
        opts.setdefault("kafka.fetch.max.wait.ms", str(FETCH_MAX_WAIT_MS))
        opts["kafka.bootstrap.servers"] = self.bootstrap_servers
        return opts

    def client_config(self) -> ClientConfig:
        """The same connection for confluent-kafka clients (librdkafka names), or why there is none.

        Java-only options are translated where librdkafka has an equivalent (a PLAIN or SCRAM JAAS login becomes
        ``sasl.username``/``sasl.password``, ``sasl.mechanism`` ``sasl.mechanisms``, PEM and PKCS#12 stores their
        locations) and dropped where librdkafka's default does the same; options that are not about security
        are Spark's consumer's alone and are left out.
        """
        given = dict(self.options)
        conf = {"bootstrap.servers": self.bootstrap_servers}
        conf.update({key: value for key, value in given.items() if key in _LIBRDKAFKA_ONLY or key in _SHARED})
        if "sasl.mechanism" in given:
            conf.setdefault("sasl.mechanisms", given["sasl.mechanism"])
        mechanism = conf.get("sasl.mechanisms", "").upper()
        if mechanism in ("GSSAPI", "OAUTHBEARER"):  # librdkafka's own settings for them differ from Java's
            return ClientConfig(None, f"sasl.mechanism {mechanism} is set up for Java clients only")
        for key in _JAVA_ONLY_LOGIN:
            if key in given:
                return ClientConfig(None, f"{key} is a Java class, which librdkafka cannot load")
        if "sasl.jaas.config" in given:
            entry = parse_jaas(given["sasl.jaas.config"])
            if entry is None:
                return ClientConfig(None, "sasl.jaas.config does not parse as a JAAS login module entry")
            login = entry.password_login
            if login is None:
                return ClientConfig(None, f"sasl.jaas.config uses {entry.module}, which only Java clients can run")
            conf.setdefault("sasl.username", entry.options.get("username", ""))
            conf.setdefault("sasl.password", entry.options.get("password", ""))
            conf.setdefault("sasl.mechanisms", login)
        untranslatable = _translate_stores(given, conf)
        if untranslatable:
            return ClientConfig(None, untranslatable)
        algorithm = given.get("ssl.endpoint.identification.algorithm")
        if algorithm is not None:
            conf["ssl.endpoint.identification.algorithm"] = algorithm.lower() or "none"
        return ClientConfig(conf)

    def redacted(self) -> dict[str, str]:
        """The options with secret-looking values masked, safe to log."""
        return _redact(dict(self.options))

    def __repr__(self) -> str:
        return f"KafkaConfig(bootstrap_servers={self.bootstrap_servers!r}, options={self.redacted()!r})"


def _redact(options: Mapping[str, str]) -> dict[str, str]:
    return {
        key: ("***" if any(hint in key.lower() for hint in _SECRET_HINTS) else value) for key, value in options.items()
    }


def _translate_stores(given: Mapping[str, str], conf: dict[str, str]) -> str | None:
    """Put Java's trust and key stores into ``conf`` in librdkafka's names; or say which one cannot be."""
    if "ssl.truststore.location" in given or "ssl.truststore.certificates" in given:
        kind = given.get("ssl.truststore.type", "JKS").upper()
        if kind != "PEM":
            return (
                f"ssl.truststore.location is a {kind} trust store, which librdkafka cannot read (it takes PEM: "
                'ssl.truststore.type = "PEM", or ssl.ca.location)'
            )
        if "ssl.truststore.certificates" in given:
            conf.setdefault("ssl.ca.pem", given["ssl.truststore.certificates"])
        else:
            conf.setdefault("ssl.ca.location", given["ssl.truststore.location"])
    if "ssl.keystore.certificate.chain" in given and "ssl.keystore.key" in given:
        conf.setdefault("ssl.certificate.pem", given["ssl.keystore.certificate.chain"])
        conf.setdefault("ssl.key.pem", given["ssl.keystore.key"])
    elif "ssl.keystore.location" in given:
        kind = given.get("ssl.keystore.type", "JKS").upper()
        if kind == "PKCS12":
            conf["ssl.keystore.location"] = given["ssl.keystore.location"]
            if "ssl.keystore.password" in given:
                conf["ssl.keystore.password"] = given["ssl.keystore.password"]
        elif kind == "PEM":  # one file with the key and the certificate chain, as librdkafka reads both
            conf.setdefault("ssl.certificate.location", given["ssl.keystore.location"])
            conf.setdefault("ssl.key.location", given["ssl.keystore.location"])
        else:
            return (
                f"ssl.keystore.location is a {kind} key store, which librdkafka cannot read (it takes "
                'ssl.keystore.type = "PKCS12" or "PEM")'
            )
    return None


#: Consumer options the replica decides itself, and the fix for each: Spark's Kafka source refuses the first ones
#: when the query starts (after the tables were created), and the replica reads committed records only.
_OWN_OPTIONS = {
    "auto.offset.reset": "remove it: where a replica starts is source.starting_offsets, then its checkpoint",
    "enable.auto.commit": "remove it: the replica's checkpoint and its Delta commits hold its offsets",
    "key.deserializer": "remove it: the replica decodes the bytes itself",
    "value.deserializer": "remove it: the replica decodes the bytes itself",
    "interceptor.classes": "remove it: Spark's Kafka source takes no interceptors",
    "isolation.level": "remove it: the replica reads committed records only (an aborted transaction is never applied)",
}


def _check_kafka_options(r: _Reader, kafka: KafkaConfig) -> None:
    """An option the replica sets itself, or a JAAS login Kafka's client would refuse, is an error at load time,
    not a failure of the running query."""
    given = dict(kafka.options)
    for option, fix in _OWN_OPTIONS.items():
        if option in given and not (option == "isolation.level" and given[option] == "read_committed"):
            raise r.fail(f"kafka.options.{option}", "is set by the replica itself", fix)
    key = "kafka.options.sasl.jaas.config"
    example = 'org.apache.kafka.common.security.plain.PlainLoginModule required username="..." password="${VAR}";'
    if "sasl.jaas.config" not in given:
        return
    entry = parse_jaas(given["sasl.jaas.config"])
    if entry is None:  # the text holds a password: never quote it
        raise r.fail(key, "is not one JAAS login entry (check the quotes and the final ';')", f"e.g. {example}")
    if entry.password_login is None:
        return
    for option in ("username", "password"):
        if option not in entry.options:
            raise r.fail(key, f"{entry.module} has no {option}", f"e.g. {example}")
    if "sasl.mechanism" not in given and "sasl.mechanisms" not in given:
        fix = '"PLAIN"' if entry.password_login == "PLAIN" else '"SCRAM-SHA-512" or "SCRAM-SHA-256"'
        raise r.fail(
            "kafka.options.sasl.mechanism",
            f"missing: Kafka's client would log in with GSSAPI (Kerberos), not with {entry.module}",
            f'set "sasl.mechanism" = {fix}',
        )


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
    layout: str = COPY_ON_WRITE
    #: merge-on-read: the replica folds the change log into the table after every this-many-th batch (by batch
    #: id); 0 leaves folding to ``jobs/maintain.py --fold``.
    fold_every_batches: int = 10
    #: Whether the table is created with Delta's deletion vectors, so that a MERGE into a large table marks the
    #: rows it replaces instead of rewriting their files. Readers without deletion-vector support (the
    #: ``deltalake`` package's pyarrow and pandas readers, Polars) cannot open such a table at all; with False
    #: every MERGE rewrites the files it touches.
    deletion_vectors: bool = True
    #: What a field the schema does not declare does: ``add_columns`` adds it to the table as a nullable column
    #: (unless ``include_columns`` lists what to keep); ``strict`` leaves the table as declared and counts the
    #: records that carried it. Either way a change of the ``schema`` itself (a column added, a type widened) is
    #: applied to the table at the next start.
    schema_evolution: str = ADD_COLUMNS
    #: ``hold_key``: once a record of a key is quarantined, the key's later records are held in the quarantine
    #: too (never applied out of order) until the record is replayed or dropped (``./replica quarantine``);
    #: ``skip``: the key's later records are applied as they come.
    on_poison: str = HOLD_KEY

    @property
    def holds_keys(self) -> bool:
        return self.on_poison == HOLD_KEY

    @property
    def merge_on_read(self) -> bool:
        return self.layout == MERGE_ON_READ


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
    #: Where per-batch metrics are appended (one row per batch, :mod:`replica_lib.metrics`); None: the log only.
    metrics: Target | None = None

    @property
    def topics(self) -> tuple[str, ...]:
        return tuple(sorted({table.topic for table in self.tables}))

    def table(self, name: str) -> TableConfig:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(name)

    def table_named(self, name: str | None, key: str) -> TableConfig:
        """The table ``name`` (the only table if None) for a user's argument ``key``; a ConfigError otherwise."""
        if name is None and len(self.tables) == 1:
            return self.tables[0]
        for table in self.tables:
            if table.name == name:
                return table
        raise ConfigError(
            self.source_file,
            key,
            "the replica has several tables" if name is None else f"replica {self.name} has no table {name!r}",
            f"name one of {', '.join(t.name for t in self.tables)}",
        )


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
        if path is not None:
            self.no_tilde(f"{where}.path", path)
        return Target(path=path, table=table)

    def no_tilde(self, key: str, path: str) -> None:
        """Refuse a path that starts with ``~``: nothing expands it, so a folder named ``~`` would be made where the
        job runs."""
        if path.startswith("~"):
            raise self.fail(key, f"{path!r} starts with ~, which is not expanded", "give an absolute path")


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
    """Validate an already-parsed replica document: every section, then the replica's layout as a whole."""
    r = _Reader(source, environ)
    r.only(doc, "", {"replica", "kafka", "source", "trigger", "compaction", "tables"})
    rep = r.section(
        doc, "replica", {"name", "checkpoint", "quarantine", "metrics", "tombstone_retention"}, required=True
    )
    name = r.string(rep, "name", "replica")
    if not _NAME.match(name):
        raise r.fail("replica.name", f"{name!r} is not a plain name", "use letters, digits and _ only")
    if "quarantine" not in rep:
        raise r.fail("replica.quarantine", "missing", 'set quarantine = { path = "..." }')
    tables_doc = doc.get("tables")
    if not isinstance(tables_doc, dict) or not tables_doc:
        raise r.fail("tables", "no tables", "add at least one [tables.<name>] section")
    cfg = ReplicaConfig(
        name=name,
        source_file=source,
        kafka=_parse_kafka(r, doc),
        tables=tuple(_parse_table(r, tname, tdoc) for tname, tdoc in tables_doc.items()),
        source=_parse_source(r, doc),
        trigger=_parse_trigger(r, doc),
        checkpoint=_checkpoint(r, rep),
        quarantine=r.target(rep["quarantine"], "replica.quarantine"),
        tombstone_retention_s=_parse_retention(r, rep),
        compaction=_parse_compaction(r, doc),
        metrics=r.target(rep["metrics"], "replica.metrics") if "metrics" in rep else None,
    )
    _check_layout(cfg)
    _check_starting_offsets(r, cfg)
    return cfg


def _checkpoint(r: _Reader, rep: Mapping[str, Any]) -> str:
    path = r.string(rep, "checkpoint", "replica")
    r.no_tilde("replica.checkpoint", path)
    return path


#: Kafka's offsets and Spark's ``maxOffsetsPerTrigger`` are Java longs.
_LONG_MAX = 2**63 - 1


def _check_starting_offsets(r: _Reader, cfg: ReplicaConfig) -> None:
    """Spark's JSON of start offsets names every topic the replica reads, each partition a number, each offset one
    (-2: the earliest, -1: the latest): Spark checks it only once the tables and the checkpoint exist, in its
    terms."""
    text = cfg.source.starting_offsets
    if text.strip().lower() in ("earliest", "latest"):
        return
    key = "source.starting_offsets"
    example = f"e.g. starting_offsets = '{json.dumps({t: {'0': -2, '1': 42} for t in cfg.topics})}', every partition"
    offsets = json.loads(text)
    for topic, parts in offsets.items():
        if topic not in cfg.topics:
            raise r.fail(key, f"names topic {topic!r}, which no table reads ({', '.join(cfg.topics)})", example)
        if not isinstance(parts, dict) or not parts:
            raise r.fail(key, f"topic {topic!r} must map partition numbers to offsets", example)
        for partition, offset in parts.items():
            is_offset = isinstance(offset, int) and not isinstance(offset, bool) and -2 <= offset <= _LONG_MAX
            if not partition.isdigit() or not is_offset:
                raise r.fail(
                    key,
                    f"{topic}: {partition!r}: {offset!r} is not a partition number and an offset (-2: earliest, "
                    "-1: latest)",
                    example,
                )
    missing = [t for t in cfg.topics if t not in offsets]
    if missing:
        raise r.fail(key, f"has no offsets for topic(s) {', '.join(missing)} (Spark needs every one)", example)


def _parse_retention(r: _Reader, rep: Mapping[str, Any]) -> int:
    retention = r.string(rep, "tombstone_retention", "replica", "7 days")
    retention_match = _RETENTION.match(retention.strip())
    if not retention_match:
        raise r.fail(
            "replica.tombstone_retention",
            f"{retention!r} is not a duration",
            'e.g. tombstone_retention = "7 days" (seconds, minutes, hours or days)',
        )
    unit = retention_match.group(2).lower().rstrip("s")
    return int(retention_match.group(1)) * _UNIT_S[unit]


def _parse_kafka(r: _Reader, doc: Mapping[str, Any]) -> KafkaConfig:
    kaf = r.section(doc, "kafka", {"bootstrap_servers", "options"}, required=True)
    options = kaf.get("options", {})
    if not isinstance(options, dict) or not all(isinstance(v, str) for v in options.values()):
        raise r.fail("kafka.options", "must map option names to strings", '{ "security.protocol" = "SSL" }')
    for key in options:
        if key == "bootstrap.servers":
            raise r.fail("kafka.options.bootstrap.servers", "set twice", "use kafka.bootstrap_servers only")
    servers = r.string(kaf, "bootstrap_servers", "kafka")
    for server in [s.strip() for s in servers.split(",")]:
        host, _, port = server.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise r.fail(
                "kafka.bootstrap_servers",
                f"{server!r} is not host:port",
                'e.g. bootstrap_servers = "broker1:9092,broker2:9092"',
            )
    kafka = KafkaConfig(
        bootstrap_servers=servers,
        options=tuple(sorted((k, r.expand(f"kafka.options.{k}", v)) for k, v in options.items())),
    )
    _check_kafka_options(r, kafka)
    return kafka


def _parse_source(r: _Reader, doc: Mapping[str, Any]) -> SourceConfig:
    src = r.section(doc, "source", {"starting_offsets", "max_offsets_per_trigger", "fail_on_data_loss"}, False)
    max_offsets = src.get("max_offsets_per_trigger")
    if max_offsets is not None and (
        not isinstance(max_offsets, int) or isinstance(max_offsets, bool) or not 0 < max_offsets <= _LONG_MAX
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
    return SourceConfig(
        starting_offsets=starting_offsets,
        max_offsets_per_trigger=max_offsets,
        fail_on_data_loss=r.boolean(src, "fail_on_data_loss", "source", True),
    )


def _parse_trigger(r: _Reader, doc: Mapping[str, Any]) -> TriggerConfig:
    trig = r.section(doc, "trigger", {"available_now", "interval"}, required=False)
    interval = r.string(trig, "interval", "trigger", "5 seconds")
    if not _INTERVAL.match(interval.strip()):
        raise r.fail(
            "trigger.interval",
            f"{interval!r} is not a Spark duration",
            'e.g. "10 seconds" (units: milliseconds, seconds, minutes or hours)',
        )
    return TriggerConfig(available_now=r.boolean(trig, "available_now", "trigger", False), interval=interval)


def _parse_compaction(r: _Reader, doc: Mapping[str, Any]) -> CompactionConfig:
    comp = r.section(doc, "compaction", {"every_batches", "small_file_mb"}, required=False)
    return CompactionConfig(
        every_batches=r.integer(
            comp, "every_batches", "compaction", 50, 0, "e.g. every_batches = 50 (0 turns the replica's compaction off)"
        ),
        small_file_mb=r.integer(comp, "small_file_mb", "compaction", 16, 1, "e.g. small_file_mb = 16"),
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
    r.only(doc, where, allowed | {"layout", "fold_every_batches", "deletion_vectors", "schema_evolution", "on_poison"})
    on_poison = r.string(doc, "on_poison", where, HOLD_KEY)
    if on_poison not in ON_POISON:
        raise r.fail(
            f"{where}.on_poison",
            f"unknown on_poison {on_poison!r}",
            f'use "{HOLD_KEY}" (a quarantined record holds its key\'s later records) or "{SKIP}"',
        )
    evolution = r.string(doc, "schema_evolution", where, ADD_COLUMNS)
    if evolution not in SCHEMA_EVOLUTIONS:
        raise r.fail(
            f"{where}.schema_evolution",
            f"unknown schema evolution {evolution!r}",
            f'use "{ADD_COLUMNS}" (new fields become columns) or "{STRICT}" (new fields are counted, not kept)',
        )
    fmt = r.string(doc, "format", where, "native")
    if fmt not in FORMATS:
        raise r.fail(f"{where}.format", f"unknown format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    layout = r.string(doc, "layout", where, COPY_ON_WRITE)
    if layout not in LAYOUTS:
        raise r.fail(f"{where}.layout", f"unknown layout {layout!r}", f'use "{COPY_ON_WRITE}" or "{MERGE_ON_READ}"')
    if "fold_every_batches" in doc and layout != MERGE_ON_READ:
        raise r.fail(
            f"{where}.fold_every_batches",
            f"only a {MERGE_ON_READ} table folds its change log",
            f'remove fold_every_batches, or set layout = "{MERGE_ON_READ}"',
        )
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
        layout=layout,
        fold_every_batches=r.integer(
            doc, "fold_every_batches", where, 10, 0, "e.g. fold_every_batches = 10 (0: only jobs/maintain.py folds)"
        ),
        deletion_vectors=r.boolean(doc, "deletion_vectors", where, True),
        schema_evolution=evolution,
        on_poison=on_poison,
    )
    if table.include_columns and table.exclude_columns:
        raise r.fail(where, "both include_columns and exclude_columns are set", "keep only one of them")
    _check_schema(r, table)
    return table


# ---------------------------------------------------------------------------------------------- schema checks
# A pure-Python reading of the Spark DDL that a table's ``schema`` is written in (the subset a replica supports),
# so that a file is checked when it is loaded, with no JVM: the result is Spark's JSON form of the schema
# (``pyspark.sql.types.StructType.fromJson`` turns it into types; a test checks it against Spark's own parser).
_ATOMIC = {
    "boolean": "boolean",
    "tinyint": "byte",
    "byte": "byte",
    "smallint": "short",
    "short": "short",
    "int": "integer",
    "integer": "integer",
    "bigint": "long",
    "long": "long",
    "float": "float",
    "real": "float",
    "double": "double",
    "date": "date",
    "timestamp": "timestamp",
    "timestamp_ltz": "timestamp",
    "timestamp_ntz": "timestamp_ntz",
    "string": "string",
    "binary": "binary",
}
_DECIMALS = ("decimal", "dec", "numeric")
#: Spark's JSON reader takes no CHAR(n) or VARCHAR(n) (nor a Delta table's length check a record could fail).
_CHARS = ("char", "character", "varchar")
_SUPPORTED = "BOOLEAN, TINYINT, SMALLINT, INT, BIGINT, FLOAT, DOUBLE, DECIMAL(p,s), STRING, "
_SUPPORTED += "BINARY, DATE, TIMESTAMP, TIMESTAMP_NTZ, ARRAY<t>, MAP<STRING,t>, STRUCT<name: t, ...>"
_TOKEN = re.compile(
    r"\s*(?:(?P<quoted>`(?:[^`]|``)*`)|(?P<string>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
    r"|(?P<word>[A-Za-z0-9_]+)|(?P<punct>[<>(),:]))"
)
#: Characters a column or field name may not hold, and why: Delta (without column mapping) refuses the first ones
#: in a table's schema, a JSON path (how the decode reads a field of a record) cannot spell a name with a ``'``, and
#: the replica quotes names in SQL with backticks.
_UNFIT_IN_NAMES = {
    **dict.fromkeys(" ,;{}()\n\t=", "Delta refuses in a column name"),
    "'": "a JSON path (how the replica reads a field of a record) cannot spell",
    "`": "the replica's SQL cannot quote",
}
#: Key columns: types whose values compare exactly and come as plain JSON values (no NaN, no bytes, no nesting).
_KEY_TYPES = {"boolean", "byte", "short", "integer", "long", "string", "date", "timestamp", "timestamp_ntz"}
#: Sequence columns: read as a long (``decode.table_changes``), so integers only.
_SEQ_TYPES = {"byte", "short", "integer", "long"}


class DdlError(ValueError):
    """A table schema that is not Spark DDL of the supported types; says where it goes wrong."""


@dataclass(frozen=True)
class SchemaColumn:
    """One top-level column of a table schema, its type in Spark's JSON form (``"long"``, ``{"type": ...}``)."""

    name: str
    type: Any
    nullable: bool = True
    comment: str | None = None

    def json_field(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "nullable": self.nullable,
            "metadata": {} if self.comment is None else {"comment": self.comment},
        }


def _type_text(spark_type: Any) -> str:
    if isinstance(spark_type, str):
        return spark_type
    kind = spark_type["type"]
    if kind == "array":
        return f"array<{_type_text(spark_type['elementType'])}>"
    if kind == "map":
        return f"map<{_type_text(spark_type['keyType'])},{_type_text(spark_type['valueType'])}>"
    return "struct<" + ",".join(f"{f['name']}:{_type_text(f['type'])}" for f in spark_type["fields"]) + ">"


class _DdlParser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []  # (kind, value, position)
        pos = 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                if text[pos:].strip() == "":
                    break
                start = len(text[pos:]) - len(text[pos:].lstrip()) + pos
                raise DdlError(f"unexpected {text[start]!r} at character {start + 1}")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind), match.start(kind)))
            pos = match.end()
        self.i = 0

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def where(self) -> str:
        token = self.peek()
        return f"at {token[1]!r} (character {token[2] + 1})" if token else "at the end"

    def take(self, value: str) -> bool:
        token = self.peek()
        if token is not None and token[0] in ("punct", "word") and token[1].lower() == value:
            self.i += 1
            return True
        return False

    def expect(self, value: str, what: str) -> None:
        if not self.take(value):
            raise DdlError(f"expected {what} {self.where()}")

    def name(self) -> str:
        token = self.peek()
        if token is None or token[0] not in ("word", "quoted"):
            raise DdlError(f"expected a column name {self.where()}")
        self.i += 1
        name = token[1][1:-1].replace("``", "`") if token[0] == "quoted" else token[1]
        unfit = [c for c in _UNFIT_IN_NAMES if c in name]
        if unfit:
            raise DdlError(
                f"the name {name!r} (character {token[2] + 1}) holds {' and '.join(map(repr, unfit))}, which "
                f"{_UNFIT_IN_NAMES[unfit[0]]}: rename the field in the records and the schema"
            )
        return name

    def integer(self) -> int:
        token = self.peek()
        if token is None or token[0] != "word" or not token[1].isdigit():
            raise DdlError(f"expected a number {self.where()}")
        self.i += 1
        return int(token[1])

    def column(self) -> SchemaColumn:
        name = self.name()
        self.take(":")
        spark_type = self.data_type()
        nullable = True
        if self.take("not"):
            self.expect("null", "NULL after NOT")
            nullable = False
        comment = None
        if self.take("comment"):
            token = self.peek()
            if token is None or token[0] != "string":
                raise DdlError(f"expected a quoted comment {self.where()}")
            self.i += 1
            comment = re.sub(r"\\(.)", r"\1", token[1][1:-1])
        return SchemaColumn(name, spark_type, nullable, comment)

    def data_type(self) -> Any:
        token = self.peek()
        if token is None or token[0] != "word":
            raise DdlError(f"expected a type {self.where()}")
        self.i += 1
        word = token[1].lower()
        if word == "array":
            self.expect("<", "'<' after ARRAY")
            element = self.data_type()
            self.expect(">", "'>' closing ARRAY<")
            return {"type": "array", "elementType": element, "containsNull": True}
        if word == "map":
            self.expect("<", "'<' after MAP")
            key_at = self.where()
            key = self.data_type()
            if key != "string":
                raise DdlError(
                    f"MAP's key type {key_at} must be STRING: a MAP column holds a JSON object, whose names are "
                    f"strings (MAP<STRING, ...>)"
                )
            self.expect(",", "',' between MAP's key and value types")
            value = self.data_type()
            self.expect(">", "'>' closing MAP<")
            return {"type": "map", "keyType": key, "valueType": value, "valueContainsNull": True}
        if word == "struct":
            self.expect("<", "'<' after STRUCT")
            fields: list[SchemaColumn] = []
            if not self.take(">"):
                fields.append(self.column())
                while self.take(","):
                    fields.append(self.column())
                self.expect(">", "',' or '>' in STRUCT<")
            return {"type": "struct", "fields": [f.json_field() for f in fields]}
        if word in _DECIMALS:
            precision, scale = 10, 0
            if self.take("("):
                precision = self.integer()
                if self.take(","):
                    scale = self.integer()
                self.expect(")", "')' closing DECIMAL(")
            if not 1 <= precision <= 38 or scale > precision:
                raise DdlError(f"DECIMAL({precision},{scale}): precision must be 1 to 38 and scale at most precision")
            return f"decimal({precision},{scale})"
        if word in _CHARS:
            raise DdlError(
                f"type {token[1]!r} (character {token[2] + 1}) is not supported: declare the column STRING (Spark's "
                "JSON reader takes no CHAR or VARCHAR; the replica keeps each text as sent)"
            )
        if word in _ATOMIC:
            return _ATOMIC[word]
        raise DdlError(f"type {token[1]!r} (character {token[2] + 1}) is not supported; use one of {_SUPPORTED}")

    def schema(self) -> list[SchemaColumn]:
        if not self.tokens:
            raise DdlError("no columns")
        columns = [self.column()]
        while self.take(","):
            columns.append(self.column())
        if self.peek() is not None:
            raise DdlError(f"expected ',' or the end {self.where()}")
        return columns


def parse_schema(text: str) -> list[SchemaColumn]:
    """Parse a table's DDL schema (``"id BIGINT, name STRING"``) without Spark; raises :class:`DdlError`."""
    return _DdlParser(text).schema()


def schema_json(text: str) -> dict[str, Any]:
    """A table's DDL schema in Spark's JSON form, for ``pyspark.sql.types.StructType.fromJson``."""
    return {"type": "struct", "fields": [c.json_field() for c in parse_schema(text)]}


def check_table_schema(table: TableConfig, source_file: str) -> None:
    """Raise :class:`ConfigError` unless ``table``'s schema, keys, sequence and column lists fit together."""
    _check_schema(_Reader(source_file, {}), table)


def _check_schema(r: _Reader, table: TableConfig) -> None:
    """What a table's schema, keys and column lists must satisfy, checked from the file alone."""
    where = f"tables.{table.name}"
    try:
        columns = parse_schema(table.schema)
    except DdlError as exc:
        raise r.fail(
            f"{where}.schema", f"not a valid schema: {exc}", 'e.g. schema = "id BIGINT, name STRING"'
        ) from None
    types = {c.name: c.type for c in columns}
    seen: dict[str, str] = {}
    for column in columns:
        if column.name.startswith("_src_"):
            raise r.fail(f"{where}.schema", f"column {column.name} uses the reserved _src_ prefix", "rename it")
        if column.name.lower() in seen:
            raise r.fail(
                f"{where}.schema", f"column {column.name} is declared twice (names ignore case)", "rename or drop one"
            )
        seen[column.name.lower()] = column.name
        inner = _not_null_inside(column.type)
        if inner is not None:
            raise r.fail(
                f"{where}.schema",
                f"column {column.name} has a field {inner} declared NOT NULL inside it, which Spark's JSON reader "
                "cannot produce",
                "drop NOT NULL inside ARRAY, MAP and STRUCT (a top-level column may have it)",
            )
    _check_column_lists(r, table, types)
    _check_sequence(r, table, types)


def _not_null_inside(spark_type: Any) -> str | None:
    """The name of a STRUCT field declared NOT NULL anywhere inside a column's type (Spark's JSON form), or None."""
    if isinstance(spark_type, str):
        return None
    if spark_type["type"] == "array":
        return _not_null_inside(spark_type["elementType"])
    if spark_type["type"] == "map":
        return _not_null_inside(spark_type["valueType"])
    for member in spark_type["fields"]:
        if not member["nullable"]:
            return str(member["name"])
        inner = _not_null_inside(member["type"])
        if inner is not None:
            return inner
    return None


def _check_column_lists(r: _Reader, table: TableConfig, types: dict[str, object]) -> None:
    """Keys and column lists name columns of the schema, once each; keys have types that key a row exactly."""
    where = f"tables.{table.name}"
    names = ", ".join(types)
    for label, listed in (
        ("keys", table.keys),
        ("include_columns", table.include_columns),
        ("exclude_columns", table.exclude_columns),
    ):
        for column_name in listed:
            if column_name not in types:
                raise r.fail(f"{where}.{label}", f"{column_name} is not a column of the schema", f"use one of {names}")
        if len(set(listed)) != len(listed):
            raise r.fail(f"{where}.{label}", f"lists a column twice: {list(listed)}", "name each column once")
    for key in table.keys:
        if key in table.exclude_columns:
            raise r.fail(f"{where}.exclude_columns", f"{key} is a key column", "key columns are always kept; remove it")
        key_type = types[key]
        if not isinstance(key_type, str) or (key_type not in _KEY_TYPES and not key_type.startswith("decimal(")):
            raise r.fail(
                f"{where}.keys",
                f"key column {key} has type {_type_text(key_type)}, which cannot key a row exactly",
                "key by integer, decimal, string, date, timestamp or boolean columns",
            )


def _check_sequence(r: _Reader, table: TableConfig, types: dict[str, object]) -> None:
    """``sequence_by`` names a whole-number column, the envelope's seq or (Debezium) a payload field."""
    where = f"tables.{table.name}"
    names = ", ".join(types)
    seq = table.sequence_by
    if seq is None:
        return
    if seq in types:
        seq_type = types[seq]
        if not isinstance(seq_type, str) or (
            seq_type not in _SEQ_TYPES and not re.fullmatch(r"decimal\(\d+,0\)", seq_type)
        ):
            raise r.fail(
                f"{where}.sequence_by",
                f"column {seq} has type {_type_text(seq_type)}; a sequence is read as a whole number",
                "order by an integer column (BIGINT, INT), or by the envelope's seq",
            )
    elif table.format == "native" and seq != "seq":
        raise r.fail(
            f"{where}.sequence_by",
            f"{seq} is neither the envelope's seq nor a column of the schema",
            f'use "seq" or one of {names}',
        )
    elif table.format == "debezium" and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", seq):
        raise r.fail(
            f"{where}.sequence_by",
            f"{seq!r} is neither a column of the schema nor a field path of the Debezium payload",
            'use a column name or a payload field such as "source.lsn"',
        )


# ---------------------------------------------------------------------------------------------- layout checks
def tombstone_location(target: Target) -> Target:
    """Where a table's retained deletes live: beside it, as ``<path>__tombstones`` or ``<name>__tombstones``."""
    if target.path:
        return Target(path=target.path.rstrip("/") + "__tombstones")
    return Target(table=f"{target.table}__tombstones")


def resolved_location(quarantine: Target) -> Target:
    """Where a replica's quarantined records that were replayed or dropped are listed: ``<quarantine>__resolved``."""
    if quarantine.path:
        return Target(path=quarantine.path.rstrip("/") + "__resolved")
    return Target(table=f"{quarantine.table}__resolved")


def changes_location(target: Target) -> Target:
    """Where a merge-on-read table's change log lives: ``<path>__changes`` or ``<name>__changes``."""
    if target.path:
        return Target(path=target.path.rstrip("/") + "__changes")
    return Target(table=f"{target.table}__changes")


def _location(path: str) -> str:
    """A path compared as a location: ``file:`` and trailing slashes dropped, ``.`` and ``..`` resolved."""
    if path.startswith("file://"):
        path = path[len("file://") :]
    elif path.startswith("file:"):
        path = path[len("file:") :]
    if "://" in path:
        scheme, rest = path.split("://", 1)
        return f"{scheme.lower()}://{os.path.normpath('/' + rest).lstrip('/')}"
    return os.path.normpath(os.path.abspath(path))


def _overlap(place: str, other: str) -> bool:
    """Whether two places are the same, or one path lies inside the other (catalog names only match exactly)."""
    if place.startswith("table:") or other.startswith("table:"):
        return place == other
    return any(a == b or a.startswith(b.rstrip("/") + "/") for a, b in ((place, other), (other, place)))


def _place(target: Target) -> str:
    return _location(target.path) if target.path else f"table:{str(target.table).lower()}"


def _storage(cfg: ReplicaConfig) -> list[tuple[str, str, str]]:
    """Every place a replica writes a table: (what, config key, location or ``table:<catalog name>``)."""
    places = []
    for table in cfg.tables:
        key = f"tables.{table.name}.target"
        places.append((f"table {table.name}", key, _place(table.target)))
        places.append((f"the retained deletes of {table.name}", key, _place(tombstone_location(table.target))))
        if table.merge_on_read:
            places.append((f"the change log of {table.name}", key, _place(changes_location(table.target))))
    places.append(("the quarantine table", "replica.quarantine", _place(cfg.quarantine)))
    if cfg.metrics is not None:
        places.append(("the metrics table", "replica.metrics", _place(cfg.metrics)))
    return places


def _check_layout(cfg: ReplicaConfig) -> None:
    """Each table, its retained deletes, the quarantine and the checkpoint in a place of its own; one format per topic.

    Two writers in one place mix their rows (and a folder inside a table's folder is deleted by its VACUUM).
    """
    r = _Reader(cfg.source_file, {})
    places = _storage(cfg)
    for i, (what, key, place) in enumerate(places):
        for other_what, _, other in places[:i]:
            if _overlap(place, other):
                raise r.fail(
                    key,
                    f"{what} and {other_what} share a location ({place})",
                    "give every table a folder of its own, apart from the others and from their <path>__tombstones "
                    "(and <path>__changes)",
                )
    checkpoint = _location(cfg.checkpoint)
    for what, key, place in places:
        if _overlap(checkpoint, place):
            raise r.fail(
                "replica.checkpoint",
                f"{cfg.checkpoint} overlaps the location of {what} ({key})",
                "keep the checkpoint in a folder of its own, outside every table",
            )
    by_topic: dict[str, list[TableConfig]] = {}
    for table in cfg.tables:
        by_topic.setdefault(table.topic, []).append(table)
    for topic, tables in by_topic.items():
        formats = sorted({t.format for t in tables})
        if len(formats) > 1:
            raise r.fail(
                f"tables.{tables[-1].name}.format",
                f"topic {topic} feeds tables of different formats ({', '.join(formats)})",
                "a topic has one format: give every table of the topic the same format",
            )
        if formats == ["debezium"] and len(tables) > 1:
            raise r.fail(
                f"tables.{tables[-1].name}.topic",
                f"Debezium topic {topic} feeds {len(tables)} tables ({', '.join(t.name for t in tables)}), and its "
                "records name no replica table",
                "Debezium writes one table per topic: give each table its own topic",
            )


def load_replicas(paths: Sequence[str | Path], environ: Mapping[str, str] | None = None) -> tuple[ReplicaConfig, ...]:
    """Load replica files that run side by side: each needs its own name, checkpoint and table locations."""
    configs = tuple(load_replica(path, environ) for path in paths)
    for i, cfg in enumerate(configs):
        r = _Reader(cfg.source_file, {})
        mine = [*_storage(cfg), ("its checkpoint", "replica.checkpoint", _location(cfg.checkpoint))]
        for other in configs[:i]:
            if cfg.name == other.name:
                raise r.fail(
                    "replica.name", f"{cfg.name} is also the name of {other.source_file}", "name each replica once"
                )
            theirs = [*_storage(other), ("its checkpoint", "replica.checkpoint", _location(other.checkpoint))]
            for what, key, place in mine:
                for other_what, _, other_place in theirs:
                    if _overlap(place, other_place):
                        raise r.fail(
                            key,
                            f"{what} and {other_what} of replica {other.name} ({other.source_file}) share a location "
                            f"({place})",
                            "give each replica its own checkpoint and table locations",
                        )
    return configs
