"""Shared fixtures: one SparkSession (local[2], Delta, Kafka source) and one real Kafka broker per test run."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from replica_dev.embedded_kafka import EmbeddedKafka
from replica_lib.config import LocalSettings, local_settings
from replica_lib.session import build_session
from replica_lib.topics import TopicAdmin, TopicSpec

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

# The Spark jobs the tests launch (spark-submit.sh, ./replica, notebook kernels) live for a few batches, which a
# JVM compiling with C1 only runs faster (a replica launched on 100 records, start to exit: 43-46 s with the
# default, 31-33 s with this); the run's own session lives an hour and keeps the default, where C1's code loses,
# as does the benchmark's smoke run. Spark's launcher adds SPARK_SUBMIT_OPTS to a driver's JVM options. A JVM that
# compiles with C1 only reserves 48 MB for compiled code where the default reserves 240 MB: a chaos replica of both
# layouts filled 48 MB within 15 s, and with the JIT off the JVM then failed to link method handles (the replica
# died). So the code cache keeps the default's size.
C1_ONLY = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
_OWN_SUBMIT_OPTS = os.environ.get("SPARK_SUBMIT_OPTS")
os.environ["SPARK_SUBMIT_OPTS"] = " ".join(filter(None, (_OWN_SUBMIT_OPTS, C1_ONLY)))
# The same for the other short JVMs Spark's scripts start: beeline's, and a standalone cluster's master and workers.
for _opts in ("SPARK_BEELINE_OPTS", "SPARK_DAEMON_JAVA_OPTS"):
    os.environ[_opts] = " ".join(filter(None, (os.environ.get(_opts), C1_ONLY)))


def default_jvm_environ() -> dict[str, str]:
    """The environment for a Spark driver that runs long: the JVM options as the user's environment has them."""
    env = {k: v for k, v in os.environ.items() if k != "SPARK_SUBMIT_OPTS"}
    return env if _OWN_SUBMIT_OPTS is None else {**env, "SPARK_SUBMIT_OPTS": _OWN_SUBMIT_OPTS}


@contextmanager
def _default_jvm(*options: str) -> Iterator[None]:
    launched = os.environ.pop("SPARK_SUBMIT_OPTS")
    own = " ".join(filter(None, (_OWN_SUBMIT_OPTS, *options)))
    if own:
        os.environ["SPARK_SUBMIT_OPTS"] = own
    try:
        yield
    finally:
        os.environ["SPARK_SUBMIT_OPTS"] = launched


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The benchmark's smoke test runs last: its job starts with the first integration test and runs beside the
    others (tests/integration/test_bench.py)."""
    bench = "tests/integration/test_bench.py::"
    items.sort(key=lambda item: item.nodeid.startswith(bench))  # a stable sort: the others keep their order


@pytest.fixture(scope="session", autouse=True)
def catalog_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's own local catalog: replicas started by tests leave their names there, not in the checkout's."""
    path = tmp_path_factory.mktemp("catalog")
    os.environ["REPLICA_CATALOG_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def settings(catalog_dir: Path) -> LocalSettings:
    return local_settings()


# The run's session collects its garbage with the parallel collector: G1's concurrent marking took 52 s of CPU and
# its workers 24 s in 7.5 minutes of test_semantics.py, on a machine whose two cores the tests keep busy. In a new
# session each time: test_semantics.py 419 s with G1, 379 s with this; test_layouts.py 295 s and 298 s, then 259 s
# and 249 s.
SESSION_GC = "-XX:+UseParallelGC"

# The run's session evaluates expressions without generating code: its queries read a few rows each, and most are
# planned once, so compiling their generated classes (Janino, then the JVM's JIT on the result) costs more than it
# saves (two tests of test_semantics.py in a new session: 132 s with code generation, 100 s without). Both modes are
# Spark's own and give the same rows; the jobs the tests launch, as users run them, keep Spark's default, and so do
# the decode's tests (the `production_codegen` fixture).
NO_CODEGEN = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}


@pytest.fixture(scope="session")
def spark(settings: LocalSettings) -> Iterator[SparkSession]:
    with _default_jvm(SESSION_GC):  # pyspark starts the session's JVM with os.environ
        session = build_session(
            "replica-tests",
            settings,
            master="local[2]",
            extra={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2", **NO_CODEGEN},
        )
    yield session
    session.stop()


@pytest.fixture
def production_codegen(spark: SparkSession) -> Iterator[None]:
    """Spark's default code generation for one test, as a replica job runs: for the decode's expressions."""
    for key in NO_CODEGEN:
        spark.conf.unset(key)  # Spark's own default, whatever its value
    try:
        yield
    finally:
        for key, value in NO_CODEGEN.items():
            spark.conf.set(key, value)


@pytest.fixture(scope="session")
def kafka(settings: LocalSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedKafka]:
    # The log cleaner looks for work every 0.5 s (15 s by default), so a test can wait for it to compact a topic.
    # The controller fences a broker it has not heard from in broker.session.timeout.ms (2 s on an embedded broker,
    # so that one killed can register again soon), then moves every partition's leader. This broker is never
    # killed, but a test pauses it (SIGSTOP) for 12 s or more, and a loaded machine can starve it: after one such
    # fencing a reader of the paused topic found no record in 60 s.
    broker = EmbeddedKafka(
        tmp_path_factory.mktemp("broker"),
        settings.state_dir,
        settings.java_home,
        properties={"log.cleaner.backoff.ms": "500", "broker.session.timeout.ms": "60000"},
    )
    with broker:
        yield broker


@pytest.fixture
def connection(kafka: EmbeddedKafka) -> dict[str, str]:
    return {"bootstrap.servers": kafka.bootstrap_servers}


@pytest.fixture
def topic_factory(connection: dict[str, str]) -> object:
    """Creates uniquely named local topics: ``topic_factory(partitions=3) -> name``."""
    admin = TopicAdmin(connection)

    def create(partitions: int = 3, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        admin.ensure(TopicSpec.local(name, partitions=partitions), local=True)
        return name

    return create
