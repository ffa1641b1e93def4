"""Kafka security options: written for Spark's Java client or for librdkafka, each client gets its own names."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from replica_lib.config import FETCH_MAX_WAIT_MS, ClientConfig, KafkaConfig, ReplicaConfig, parse_jaas, parse_replica
from replica_lib.errors import ConfigError

SOURCE = "secure.toml"
PASSWORD = 'pa"ss\\word-7'  # a quote and a backslash, escaped in the JAAS text below
PLAIN_JAAS = 'org.apache.kafka.common.security.plain.PlainLoginModule required username="replica" password="${PW}";'
SCRAM_JAAS = 'org.apache.kafka.common.security.scram.ScramLoginModule required username="u" password="${PW}";'
KERBEROS_JAAS = (
    'com.sun.security.auth.module.Krb5LoginModule required useKeyTab=true keyTab="/etc/k.keytab" '
    'principal="replica@EXAMPLE.COM";'
)


def load(options: dict[str, str], password: str = "s3cret") -> ReplicaConfig:
    doc: dict[str, Any] = {
        "replica": {"name": "r1", "checkpoint": "/cp/r1", "quarantine": {"path": "/q/r1"}},
        "kafka": {"bootstrap_servers": "b:9092", "options": copy.deepcopy(options)},
        "tables": {"orders": {"topic": "orders", "keys": ["id"], "schema": "id BIGINT", "target": {"path": "/t/o"}}},
    }
    return parse_replica(doc, SOURCE, {"PW": password})


def settings(options: dict[str, str], password: str = "s3cret") -> dict[str, str]:
    client = load(options, password).kafka.client_config()
    assert client.settings is not None, client.reason
    return dict(client.settings)


def load_error(options: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(options)
    return info.value


# ---------------------------------------------------------------------------------------------- Java → librdkafka
def test_a_plain_jaas_login_becomes_librdkafka_user_and_password() -> None:
    options = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.jaas.config": PLAIN_JAAS}
    assert settings(options) == {
        "bootstrap.servers": "b:9092",
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": "PLAIN",
        "sasl.username": "replica",
        "sasl.password": "s3cret",
    }


def test_a_scram_login_keeps_its_mechanism() -> None:
    options = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256", "sasl.jaas.config": SCRAM_JAAS}
    conf = settings(options)
    assert (conf["sasl.mechanisms"], conf["sasl.username"], conf["sasl.password"]) == ("SCRAM-SHA-256", "u", "s3cret")


def test_jaas_values_are_unescaped_as_javas_parser_does() -> None:
    jaas = PLAIN_JAAS.replace("${PW}", PASSWORD.replace("\\", "\\\\").replace('"', '\\"'))
    conf = settings({"sasl.mechanism": "PLAIN", "sasl.jaas.config": jaas})
    assert conf["sasl.password"] == PASSWORD
    entry = parse_jaas('x.y.PlainLoginModule  required\n username=bare password="" ;')
    assert entry is not None
    assert dict(entry.options) == {"username": "bare", "password": ""}


def test_shaded_login_modules_count_as_kafkas() -> None:
    jaas = PLAIN_JAAS.replace("org.apache", "kafkashaded.org.apache")
    assert settings({"sasl.mechanism": "PLAIN", "sasl.jaas.config": jaas})["sasl.username"] == "replica"


def test_pem_and_pkcs12_stores_become_librdkafka_locations() -> None:
    options = {
        "security.protocol": "SSL",
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": "/etc/ca.pem",
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": "/etc/me.p12",
        "ssl.keystore.password": "ks",
        "ssl.endpoint.identification.algorithm": "",
        "ssl.enabled.protocols": "TLSv1.3",  # Java's own: librdkafka negotiates TLS by itself
    }
    assert settings(options) == {
        "bootstrap.servers": "b:9092",
        "security.protocol": "SSL",
        "ssl.ca.location": "/etc/ca.pem",
        "ssl.keystore.location": "/etc/me.p12",
        "ssl.keystore.password": "ks",
        "ssl.endpoint.identification.algorithm": "none",
    }
    pem_keystore = settings({"ssl.keystore.type": "PEM", "ssl.keystore.location": "/etc/me.pem"})
    assert (pem_keystore["ssl.certificate.location"], pem_keystore["ssl.key.location"]) == ("/etc/me.pem",) * 2


def test_options_that_are_not_about_security_stay_with_spark() -> None:
    cfg = load({"max.poll.records": "500", "client.dns.lookup": "use_all_dns_ips"})
    assert cfg.kafka.client_config() == ClientConfig({"bootstrap.servers": "b:9092"})
    assert cfg.kafka.spark_options()["kafka.max.poll.records"] == "500"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"ssl.truststore.location": "/etc/trust.jks", "ssl.truststore.password": "x"}, "ssl.truststore.location"),
        ({"ssl.truststore.type": "PKCS12", "ssl.truststore.location": "/etc/t.p12"}, "ssl.truststore.location"),
        ({"ssl.keystore.location": "/etc/me.jks", "ssl.keystore.password": "x"}, "ssl.keystore.location"),
        ({"sasl.mechanism": "GSSAPI", "sasl.jaas.config": KERBEROS_JAAS}, "sasl.mechanism"),
        ({"sasl.mechanism": "OAUTHBEARER"}, "sasl.mechanism"),
        ({"sasl.mechanism": "PLAIN", "sasl.jaas.config": KERBEROS_JAAS}, "sasl.jaas.config"),
        ({"sasl.login.callback.handler.class": "com.example.Login"}, "sasl.login.callback.handler.class"),
    ],
)
def test_what_librdkafka_cannot_do_is_no_config_and_a_reason_naming_the_option(
    options: dict[str, str], named: str
) -> None:
    client = load(options).kafka.client_config()
    assert client.settings is None
    assert client.reason.startswith(named)


# ---------------------------------------------------------------------------------------------- librdkafka → Java
def test_librdkafka_names_reach_spark_in_javas() -> None:
    cfg = load(
        {
            "security.protocol": "SASL_SSL",
            "sasl.mechanisms": "SCRAM-SHA-512",
            "sasl.username": "u",
            "sasl.password": PASSWORD,
            "ssl.ca.location": "/etc/ca.pem",
        }
    )
    assert cfg.kafka.spark_options() == {
        "kafka.bootstrap.servers": "b:9092",
        "kafka.fetch.max.wait.ms": str(FETCH_MAX_WAIT_MS),
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required username="u" '
        'password="pa\\"ss\\\\word-7";',
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.location": "/etc/ca.pem",
    }
    jaas = parse_jaas(cfg.kafka.spark_options()["kafka.sasl.jaas.config"])
    assert jaas is not None
    assert jaas.options["password"] == PASSWORD  # what Java reads back is the password given
    assert settings(dict(cfg.kafka.options))["sasl.password"] == PASSWORD


def test_spark_consumers_do_not_wait_on_the_brokers_long_poll_unless_told_to() -> None:
    # A task that reads up to the log's end would otherwise wait fetch.max.wait.ms (500 ms) for its offset range.
    assert load({}).kafka.spark_options()["kafka.fetch.max.wait.ms"] == str(FETCH_MAX_WAIT_MS) == "10"
    assert load({"fetch.max.wait.ms": "200"}).kafka.spark_options()["kafka.fetch.max.wait.ms"] == "200"
    assert "fetch.max.wait.ms" not in settings({})  # Spark's consumers' setting, not confluent-kafka's


def test_java_names_reach_spark_unchanged() -> None:
    options = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.jaas.config": PLAIN_JAAS}
    assert load(options).kafka.spark_options() == {
        "kafka.bootstrap.servers": "b:9092",
        "kafka.fetch.max.wait.ms": str(FETCH_MAX_WAIT_MS),
        "kafka.security.protocol": "SASL_PLAINTEXT",
        "kafka.sasl.mechanism": "PLAIN",
        "kafka.sasl.jaas.config": PLAIN_JAAS.replace("${PW}", "s3cret"),
    }


# ---------------------------------------------------------------------------------------------- load-time errors
@pytest.mark.parametrize(
    "jaas",
    [
        'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" password="${PW}"',  # no ;
        'org.apache.kafka.common.security.plain.PlainLoginModule username="u" password="${PW}";',  # no flag
        'org.apache.kafka.common.security.plain.PlainLoginModule required username="u password="${PW}";',
        "${PW}",
    ],
)
def test_jaas_that_does_not_parse_is_one_line_naming_file_and_key_never_the_password(jaas: str) -> None:
    err = load_error({"sasl.mechanism": "PLAIN", "sasl.jaas.config": jaas})
    assert (err.source, err.key) == (SOURCE, "kafka.options.sasl.jaas.config")
    assert "PlainLoginModule required username=" in err.fix
    assert "s3cret" not in str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("auto.offset.reset", "latest", "source.starting_offsets"),
        ("enable.auto.commit", "true", "checkpoint"),
        ("key.deserializer", "x", "decodes the bytes itself"),
        ("value.deserializer", "x", "decodes the bytes itself"),
        ("interceptor.classes", "x", "no interceptors"),
        ("isolation.level", "read_uncommitted", "committed records only"),
    ],
)
def test_an_option_the_replica_sets_itself_is_refused_at_load(option: str, value: str, says: str) -> None:
    err = load_error({option: value})
    assert (err.key, err.problem) == (f"kafka.options.{option}", "is set by the replica itself")
    assert says in err.fix


def test_read_committed_may_be_said_again() -> None:
    assert (
        load({"isolation.level": "read_committed"}).kafka.spark_options()["kafka.isolation.level"] == "read_committed"
    )


def test_a_password_login_without_a_password_or_a_mechanism_is_an_error() -> None:
    err = load_error({"sasl.mechanism": "PLAIN", "sasl.jaas.config": PLAIN_JAAS.replace(' password="${PW}"', "")})
    assert err.key == "kafka.options.sasl.jaas.config"
    assert "has no password" in err.problem
    err = load_error({"sasl.jaas.config": PLAIN_JAAS})
    assert err.key == "kafka.options.sasl.mechanism"
    assert err.fix == 'set "sasl.mechanism" = "PLAIN"'


def test_a_kerberos_login_loads() -> None:
    cfg = load({"sasl.mechanism": "GSSAPI", "sasl.jaas.config": KERBEROS_JAAS})
    assert cfg.kafka.spark_options()["kafka.sasl.jaas.config"] == KERBEROS_JAAS


# ---------------------------------------------------------------------------------------------- no leaks
def test_no_repr_shows_a_password() -> None:
    options = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.jaas.config": PLAIN_JAAS}
    cfg = load(options, password="canary-123")
    entry = parse_jaas(dict(cfg.kafka.options)["sasl.jaas.config"])
    for text in (repr(cfg), repr(cfg.kafka), repr(cfg.kafka.client_config()), repr(entry)):
        assert "canary-123" not in text
    assert "'sasl.password': '***'" in repr(cfg.kafka.client_config())


def test_a_kafka_config_built_in_code_with_bad_jaas_skips_the_checks() -> None:
    kafka = KafkaConfig("b:9092", (("sasl.jaas.config", "not jaas"), ("sasl.mechanism", "PLAIN")))
    assert kafka.client_config() == ClientConfig(None, "sasl.jaas.config does not parse as a JAAS login module entry")
