"""replica_lib.config: loading conf/ files, ${VAR} expansion, validation errors and secret redaction."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from replica_dev.conf import ORDERS_SCHEMA
from replica_lib.config import (
    FETCH_MAX_WAIT_MS,
    CompactionConfig,
    KafkaConfig,
    ReplicaConfig,
    SourceConfig,
    TableConfig,
    Target,
    TriggerConfig,
    load_replica,
    parse_replica,
)
from replica_lib.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
ENV = {"REPLICA_DATA_DIR": "/tmp/x", "REPLICA_BOOTSTRAP_SERVERS": "h:1"}
SOURCE = "test.toml"


def base_doc() -> dict[str, Any]:
    """A minimal valid replica document (as tomllib would parse it)."""
    return {
        "replica": {"name": "r1", "checkpoint": "/cp/r1", "quarantine": {"path": "/q/r1"}},
        "kafka": {"bootstrap_servers": "b:9092"},
        "tables": {
            "orders": {
                "topic": "orders",
                "keys": ["order_id"],
                "schema": ORDERS_SCHEMA,
                "target": {"path": "/t/orders"},
            }
        },
    }


def with_value(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """``base_doc()`` with ``value`` set at ``path`` (creating sections on the way)."""
    doc = copy.deepcopy(base_doc())
    node = doc
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value
    return doc


def config_error(doc: dict[str, Any], environ: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_replica(doc, SOURCE, environ or {})
    return info.value


# ---------------------------------------------------------------------------------------------- conf/ files
@pytest.mark.parametrize("name", ["orders_a", "orders_b"])
def test_shipped_replica_files_load(name: str) -> None:
    path = CONF / f"{name}.toml"
    cfg = load_replica(path, environ=ENV)
    assert cfg == ReplicaConfig(
        name=name,
        source_file=str(path),
        kafka=KafkaConfig(bootstrap_servers="h:1", options=()),
        checkpoint=f"/tmp/x/{name}/_checkpoint",
        quarantine=Target(path=f"/tmp/x/{name}/_quarantine"),
        tables=(
            TableConfig(
                name="orders",
                topic="orders",
                keys=("order_id",),
                schema=ORDERS_SCHEMA,
                target=Target(path=f"/tmp/x/{name}/orders"),
                format="native",
                sequence_by="seq",
            ),
        ),
        source=SourceConfig(starting_offsets="earliest", max_offsets_per_trigger=100000, fail_on_data_loss=True),
        trigger=TriggerConfig(available_now=False, interval="5 seconds"),
        metrics=Target(path=f"/tmp/x/{name}/_metrics") if name == "orders_a" else None,
    )
    assert cfg.topics == ("orders",)
    assert cfg.table("orders") is cfg.tables[0]


def test_shipped_file_uses_the_bootstrap_default_when_unset() -> None:
    cfg = load_replica(CONF / "orders_a.toml", environ={"REPLICA_DATA_DIR": "/d"})
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert cfg.checkpoint == "/d/orders_a/_checkpoint"


def test_defaults_of_optional_sections() -> None:
    cfg = parse_replica(base_doc(), SOURCE, {})
    assert cfg.source == SourceConfig(starting_offsets="earliest", max_offsets_per_trigger=None)
    assert cfg.trigger == TriggerConfig(available_now=False, interval="5 seconds")
    assert cfg.compaction == CompactionConfig(every_batches=50, small_file_mb=16)
    assert cfg.tables[0].format == "native"
    assert cfg.tables[0].sequence_by is None
    assert cfg.tables[0].include_columns == ()
    assert cfg.tables[0].exclude_columns == ()


# ---------------------------------------------------------------------------------------------- ${VAR}
def test_variables_expand_from_the_environment_with_defaults() -> None:
    doc = base_doc()
    doc["replica"]["checkpoint"] = "${ROOT}/cp/${NAME:-fallback}/x"
    doc["kafka"]["bootstrap_servers"] = "${BROKERS:-localhost:9092}"
    doc["tables"]["orders"]["target"] = {"path": "${ROOT:-/unused}/orders"}
    cfg = parse_replica(doc, SOURCE, {"ROOT": "/data", "NAME": "n1"})
    assert cfg.checkpoint == "/data/cp/n1/x"
    assert cfg.kafka.bootstrap_servers == "localhost:9092"
    assert cfg.tables[0].target == Target(path="/data/orders")


def test_empty_variable_falls_back_to_the_default() -> None:
    doc = with_value(("replica", "checkpoint"), "${ROOT:-/default}/cp")
    assert parse_replica(doc, SOURCE, {"ROOT": ""}).checkpoint == "/default/cp"


def test_missing_variable_without_default_names_key_and_variable() -> None:
    err = config_error(with_value(("replica", "checkpoint"), "${NOPE_DIR}/cp"), {"OTHER": "1"})
    assert err.source == SOURCE
    assert err.key == "replica.checkpoint"
    assert "NOPE_DIR" in err.problem
    assert err.fix == "export NOPE_DIR=... before running"
    assert str(err) == (
        "test.toml: replica.checkpoint: environment variable NOPE_DIR is not set "
        "(fix: export NOPE_DIR=... before running)"
    )


def test_missing_variable_in_a_kafka_option_names_the_option() -> None:
    err = config_error(with_value(("kafka", "options"), {"sasl.jaas.config": "${JAAS}"}))
    assert err.key == "kafka.options.sasl.jaas.config"
    assert "JAAS" in str(err)


# ---------------------------------------------------------------------------------------------- unknown keys
@pytest.mark.parametrize(
    ("path", "key"),
    [
        (("bogus",), "bogus"),
        (("replica", "nmae"), "replica.nmae"),
        (("tables", "orders", "sequence"), "tables.orders.sequence"),
        (("kafka", "bootstrap"), "kafka.bootstrap"),
        (("source", "offsets"), "source.offsets"),
        (("trigger", "once"), "trigger.once"),
        (("compaction", "every"), "compaction.every"),
    ],
)
def test_unknown_keys_are_errors(path: tuple[str, ...], key: str) -> None:
    err = config_error(with_value(path, "x"))
    assert err.key == key
    assert err.problem == "unknown key"
    assert err.fix.startswith("remove it; allowed keys here: ")
    assert str(err).startswith(f"test.toml: {key}: unknown key")


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    text = (CONF / "orders_a.toml").read_text().replace("[tables.orders]\n", "[tables.orders]\ncolour = 1\n")
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_replica(path, environ=ENV)
    assert info.value.key == "tables.orders.colour"
    assert info.value.source == str(path)
    assert str(path) in str(info.value)


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('[replica]\nname = "r1\n')
    with pytest.raises(ConfigError) as info:
        load_replica(path, environ=ENV)
    assert info.value.source == str(path)
    assert info.value.key == "(syntax)"
    assert info.value.fix == "fix the TOML syntax at that line"
    assert "line 2" in info.value.problem
    assert str(info.value).startswith(f"{path}: (syntax): ")


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"
    with pytest.raises(ConfigError) as info:
        load_replica(path, environ=ENV)
    assert info.value.key == "(file)"
    assert info.value.fix == "pass an existing file"


# ---------------------------------------------------------------------------------------------- bad values
MAX_FIX = "e.g. max_offsets_per_trigger = 100000"
INTERVAL_FIX = 'e.g. "10 seconds" (units: milliseconds, seconds, minutes or hours)'
TARGET_FIX = '{ path = "..." } or { table = "db.t" }'
EVERY_FIX = "e.g. every_batches = 50 (0 turns the replica's compaction off)"
OFFSETS_FIX = """e.g. "earliest", or per partition '{"orders": {"0": 42, "1": -2}}'"""
PARTITIONS_FIX = """e.g. starting_offsets = '{"orders": {"0": -2, "1": 42}}', every partition"""
SERVERS_FIX = 'e.g. bootstrap_servers = "broker1:9092,broker2:9092"'


@pytest.mark.parametrize(
    ("path", "value", "key", "fix"),
    [
        (("source", "max_offsets_per_trigger"), 0, "source.max_offsets_per_trigger", MAX_FIX),
        (("source", "max_offsets_per_trigger"), "x", "source.max_offsets_per_trigger", MAX_FIX),
        (("source", "max_offsets_per_trigger"), -5, "source.max_offsets_per_trigger", MAX_FIX),
        (("source", "max_offsets_per_trigger"), True, "source.max_offsets_per_trigger", MAX_FIX),
        (("source", "max_offsets_per_trigger"), 2**63, "source.max_offsets_per_trigger", MAX_FIX),  # Java's long
        (("source", "fail_on_data_loss"), "yes", "source.fail_on_data_loss", "write true or false"),
        (("source", "starting_offsets"), "earliset", "source.starting_offsets", OFFSETS_FIX),
        (("source", "starting_offsets"), "[1, 2]", "source.starting_offsets", OFFSETS_FIX),
        # Spark would refuse these only once the tables and the checkpoint exist, in its own terms.
        (("source", "starting_offsets"), '{"order": {"0": 1}}', "source.starting_offsets", PARTITIONS_FIX),
        (("source", "starting_offsets"), '{"orders": 5}', "source.starting_offsets", PARTITIONS_FIX),
        (("source", "starting_offsets"), '{"orders": {}}', "source.starting_offsets", PARTITIONS_FIX),
        (("source", "starting_offsets"), '{"orders": {"p0": 1}}', "source.starting_offsets", PARTITIONS_FIX),
        (("source", "starting_offsets"), '{"orders": {"0": -3}}', "source.starting_offsets", PARTITIONS_FIX),
        (("source", "starting_offsets"), '{"orders": {"0": 1.5}}', "source.starting_offsets", PARTITIONS_FIX),
        (("source", "starting_offsets"), '{"orders": {"0": 1e30}}', "source.starting_offsets", PARTITIONS_FIX),
        # Refused before a checkpoint folder or a lock file is made, not when the broker is called.
        (("kafka", "bootstrap_servers"), "broker1", "kafka.bootstrap_servers", SERVERS_FIX),
        (("kafka", "bootstrap_servers"), "b:9092,", "kafka.bootstrap_servers", SERVERS_FIX),
        (("kafka", "bootstrap_servers"), "b:90920", "kafka.bootstrap_servers", SERVERS_FIX),
        (("replica", "checkpoint"), "~/cp", "replica.checkpoint", "give an absolute path"),  # nothing expands ~
        (("tables", "orders", "target"), {"path": "~/t"}, "tables.orders.target.path", "give an absolute path"),
        (("trigger", "interval"), "soon", "trigger.interval", INTERVAL_FIX),
        (("trigger", "interval"), "5s", "trigger.interval", INTERVAL_FIX),
        (("trigger", "interval"), "500 ms", "trigger.interval", INTERVAL_FIX),
        (("trigger", "interval"), "1.5 minutes", "trigger.interval", INTERVAL_FIX),
        (("compaction", "every_batches"), -1, "compaction.every_batches", EVERY_FIX),
        (("compaction", "every_batches"), "50", "compaction.every_batches", EVERY_FIX),
        (("compaction", "every_batches"), True, "compaction.every_batches", EVERY_FIX),
        (("compaction", "small_file_mb"), 0, "compaction.small_file_mb", "e.g. small_file_mb = 16"),
        (("compaction", "small_file_mb"), 1.5, "compaction.small_file_mb", "e.g. small_file_mb = 16"),
        (("tables", "orders", "format"), "avro", "tables.orders.format", "use one of native, debezium"),
        (
            ("tables", "orders", "layout"),
            "mor",
            "tables.orders.layout",
            'use "copy-on-write" or "merge-on-read"',
        ),
        (
            ("tables", "orders", "fold_every_batches"),
            5,
            "tables.orders.fold_every_batches",
            'remove fold_every_batches, or set layout = "merge-on-read"',
        ),
        (("tables", "orders", "deletion_vectors"), "no", "tables.orders.deletion_vectors", "write true or false"),
        (
            ("tables", "orders", "schema_evolution"),
            "auto",
            "tables.orders.schema_evolution",
            'use "add_columns" (new fields become columns) or "strict" (new fields are counted, not kept)',
        ),
        (("tables", "orders", "keys"), [], "tables.orders.keys", "name at least one key column"),
        (("tables", "orders", "keys"), "order_id", "tables.orders.keys", '["col", ...]'),
        (("tables", "orders", "keys"), ["order id"], "tables.orders.keys", '["col", ...]'),
        (("tables", "orders", "topic"), "", "tables.orders.topic", 'quote it: "..."'),
        (("tables", "orders", "target"), {"path": "/p", "table": "db.t"}, "tables.orders.target", TARGET_FIX),
        (("tables", "orders", "target"), {}, "tables.orders.target", TARGET_FIX),
        (
            ("tables", "orders", "target"),
            {"location": "/p"},
            "tables.orders.target.location",
            "remove it; allowed keys here: path, table",
        ),
        (("replica", "name"), "orders-a", "replica.name", "use letters, digits and _ only"),
        (("kafka", "options"), {"security.protocol": 1}, "kafka.options", '{ "security.protocol" = "SSL" }'),
        (
            ("kafka", "options"),
            {"bootstrap.servers": "x:1"},
            "kafka.options.bootstrap.servers",
            "use kafka.bootstrap_servers only",
        ),
        (("tables",), {}, "tables", "add at least one [tables.<name>] section"),
        (("tables", "orders-x"), {}, "tables.orders-x", "use letters, digits and _ only"),
    ],
)
def test_bad_values_name_key_and_fix(path: tuple[str, ...], value: Any, key: str, fix: str) -> None:
    err = config_error(with_value(path, value))
    assert (err.source, err.key, err.fix) == (SOURCE, key, fix)
    assert str(err) == f"{SOURCE}: {key}: {err.problem} (fix: {fix})"


def test_compaction_can_be_tuned_or_turned_off() -> None:
    cfg = parse_replica(with_value(("compaction",), {"every_batches": 0, "small_file_mb": 64}), SOURCE, {})
    assert cfg.compaction == CompactionConfig(every_batches=0, small_file_mb=64)


def test_a_merge_on_read_table_folds_every_ten_batches_unless_told() -> None:
    doc = with_value(("tables", "orders", "layout"), "merge-on-read")
    table = parse_replica(doc, SOURCE, {}).table("orders")
    assert (table.merge_on_read, table.fold_every_batches) == (True, 10)
    doc["tables"]["orders"]["fold_every_batches"] = 0
    assert parse_replica(doc, SOURCE, {}).table("orders").fold_every_batches == 0
    doc["tables"]["orders"]["fold_every_batches"] = -1
    assert config_error(doc).key == "tables.orders.fold_every_batches"
    assert not parse_replica(base_doc(), SOURCE, {}).table("orders").merge_on_read


def test_tables_have_deletion_vectors_unless_told() -> None:
    assert parse_replica(base_doc(), SOURCE, {}).table("orders").deletion_vectors
    doc = with_value(("tables", "orders", "deletion_vectors"), False)
    assert not parse_replica(doc, SOURCE, {}).table("orders").deletion_vectors


def test_a_change_log_may_not_share_a_place_with_another_table() -> None:
    doc = with_value(("tables", "orders", "layout"), "merge-on-read")
    doc["tables"]["orders_changes"] = {**doc["tables"]["orders"], "target": {"path": "/t/orders__changes"}}
    doc["tables"]["orders_changes"].pop("layout")
    err = config_error(doc)
    assert err.key == "tables.orders_changes.target" and "the change log of orders" in err.problem


def test_both_include_and_exclude_columns_is_an_error() -> None:
    doc = base_doc()
    doc["tables"]["orders"]["include_columns"] = ["amount"]
    doc["tables"]["orders"]["exclude_columns"] = ["status"]
    err = config_error(doc)
    assert err.key == "tables.orders"
    assert err.problem == "both include_columns and exclude_columns are set"
    assert err.fix == "keep only one of them"


@pytest.mark.parametrize("missing", ["replica", "kafka"])
def test_missing_required_sections(missing: str) -> None:
    doc = base_doc()
    del doc[missing]
    err = config_error(doc)
    assert (err.key, err.problem, err.fix) == (missing, "missing section", f"add a [{missing}] section")


def test_missing_target_and_quarantine() -> None:
    doc = base_doc()
    del doc["tables"]["orders"]["target"]
    assert config_error(doc).key == "tables.orders.target"
    doc = base_doc()
    del doc["replica"]["quarantine"]
    assert config_error(doc).key == "replica.quarantine"


@pytest.mark.parametrize(
    "interval", ["5 seconds", "1.5 seconds", "500 milliseconds", "1 minute", "2 hours", "10 Seconds"]
)
def test_intervals_spark_accepts_are_valid(interval: str) -> None:
    cfg = parse_replica(with_value(("trigger", "interval"), interval), SOURCE, {})
    assert cfg.trigger.interval == interval


@pytest.mark.parametrize("offsets", ["earliest", "latest", "Latest", '{"orders": {"0": 42, "1": -2}}'])
def test_starting_offsets_spark_accepts_are_valid(offsets: str) -> None:
    cfg = parse_replica(with_value(("source", "starting_offsets"), offsets), SOURCE, {})
    assert cfg.source.starting_offsets == offsets


def test_start_offsets_name_every_topic_the_replica_reads() -> None:
    doc = with_value(("source", "starting_offsets"), '{"orders": {"0": 42}}')
    doc["tables"]["payments"] = {**doc["tables"]["orders"], "topic": "payments", "target": {"path": "/t/payments"}}
    err = config_error(doc)
    assert (err.key, err.problem) == (
        "source.starting_offsets",
        "has no offsets for topic(s) payments (Spark needs every one)",
    )
    doc["source"]["starting_offsets"] = '{"orders": {"0": 42}, "payments": {"0": -2, "1": -1}}'
    assert parse_replica(doc, SOURCE, {}).source.starting_offsets == doc["source"]["starting_offsets"]


def test_full_table_options_parse() -> None:
    doc = base_doc()
    doc["tables"]["orders"].update(
        {
            "format": "debezium",
            "sequence_by": "updated_ms",
            "exclude_columns": ["status"],
            "target": {"table": "db.orders"},
        }
    )
    doc["tables"]["lines"] = {
        "topic": "order_lines",
        "keys": ["order_id", "line"],
        "schema": "order_id BIGINT, line INT, sku STRING",
        "target": {"path": "/t/lines"},
        "include_columns": ["sku"],
    }
    cfg = parse_replica(doc, SOURCE, {})
    orders, lines = cfg.tables
    assert orders == TableConfig(
        name="orders",
        topic="orders",
        keys=("order_id",),
        schema=ORDERS_SCHEMA,
        target=Target(table="db.orders"),
        format="debezium",
        sequence_by="updated_ms",
        exclude_columns=("status",),
    )
    assert orders.target.describe() == "db.orders"
    assert lines.keys == ("order_id", "line")
    assert lines.include_columns == ("sku",)
    assert lines.target.describe() == "delta.`/t/lines`"
    assert cfg.topics == ("order_lines", "orders")


# ---------------------------------------------------------------------------------------------- kafka options
SECRET_JAAS = 'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" password="hunter2";'


def secret_config() -> ReplicaConfig:
    doc = with_value(
        ("kafka", "options"),
        {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "PLAIN",
            "sasl.jaas.config": "${JAAS}",
            "ssl.key.password": "k3y-s3cret",
            "ssl.truststore.password": "tru5t",
        },
    )
    return parse_replica(doc, SOURCE, {"JAAS": SECRET_JAAS})


def test_spark_options_prefix_every_option_with_kafka() -> None:
    cfg = secret_config()
    assert cfg.kafka.spark_options() == {
        "kafka.bootstrap.servers": "b:9092",
        "kafka.fetch.max.wait.ms": str(FETCH_MAX_WAIT_MS),
        "kafka.sasl.jaas.config": SECRET_JAAS,
        "kafka.sasl.mechanism": "PLAIN",
        "kafka.security.protocol": "SASL_SSL",
        "kafka.ssl.key.password": "k3y-s3cret",
        "kafka.ssl.truststore.password": "tru5t",
    }
    # confluent-kafka gets the same login in librdkafka's names (tests/unit/test_kafka_options.py has the rest)
    assert cfg.kafka.client_config().settings == {
        "bootstrap.servers": "b:9092",
        "sasl.mechanisms": "PLAIN",
        "sasl.password": "hunter2",
        "sasl.username": "u",
        "security.protocol": "SASL_SSL",
        "ssl.key.password": "k3y-s3cret",
    }


def test_redacted_masks_secret_looking_options() -> None:
    cfg = secret_config()
    assert cfg.kafka.redacted() == {
        "sasl.jaas.config": "***",
        "sasl.mechanism": "PLAIN",
        "security.protocol": "SASL_SSL",
        "ssl.key.password": "***",
        "ssl.truststore.password": "***",
    }


def test_repr_never_contains_secret_values() -> None:
    cfg = secret_config()
    for text in (repr(cfg), repr(cfg.kafka), str(cfg), str(cfg.kafka), f"{cfg}"):
        assert "hunter2" not in text
        assert "k3y-s3cret" not in text
        assert "tru5t" not in text
        assert "PlainLoginModule" not in text
    assert repr(cfg.kafka) == (
        "KafkaConfig(bootstrap_servers='b:9092', options={'sasl.jaas.config': '***', "
        "'sasl.mechanism': 'PLAIN', 'security.protocol': 'SASL_SSL', 'ssl.key.password': '***', "
        "'ssl.truststore.password': '***'})"
    )
