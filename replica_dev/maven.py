"""Maven artifacts for local use: the embedded Kafka broker's jars, and the packages of dev jobs.

The broker is resolved by the Ivy jar that pyspark ships, with the product's ``ivysettings.xml`` (Maven Central
only) and the same cache under ``<state>/ivy``, so after the first run everything works offline.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from replica_lib.artifacts import IVY_SETTINGS, SCALA_BINARY, SPARK_PACKAGES
from replica_lib.errors import SetupError

logger = logging.getLogger(__name__)

KAFKA_BROKER_VERSION = "4.1.1"

#: Spark's Avro functions (``from_avro``): the benchmark's peer, kafka2delta, decodes its records with them.
#: Maven Central has no spark-avro for Spark 4.2.0; 4.1.1, the newest there, is what the peer runs with.
SPARK_AVRO_VERSION = "4.1.1"
SPARK_AVRO = f"org.apache.spark:spark-avro_{SCALA_BINARY}:{SPARK_AVRO_VERSION}"

#: Packages a dev job needs beyond :data:`SPARK_PACKAGES`, by the job's file name under ``jobs/dev/``.
JOB_PACKAGES: dict[str, tuple[str, ...]] = {"bench.py": (SPARK_AVRO,)}

#: The embedded broker: Apache Kafka (KRaft) and a log4j2 binding for its slf4j logging.
BROKER_PACKAGES: tuple[str, ...] = (
    f"org.apache.kafka:kafka_{SCALA_BINARY}:{KAFKA_BROKER_VERSION}",
    "org.apache.logging.log4j:log4j-slf4j-impl:2.24.3",
)

#: Kafka Connect for the Debezium tests: the worker runtime (of the broker's version) and its JSON converter.
CONNECT_PACKAGES: tuple[str, ...] = (
    f"org.apache.kafka:connect-runtime:{KAFKA_BROKER_VERSION}",
    f"org.apache.kafka:connect-json:{KAFKA_BROKER_VERSION}",
    "org.apache.logging.log4j:log4j-slf4j-impl:2.24.3",
)
DEBEZIUM_VERSION = "3.6.1.Final"
#: Debezium's PostgreSQL connector, a Connect plugin: it goes on the worker's ``plugin.path``, in a class loader of
#: its own, so that the Kafka client it was built with (newer than the worker's) stays out of the worker's way.
DEBEZIUM_POSTGRES_PACKAGES: tuple[str, ...] = (f"io.debezium:debezium-connector-postgres:{DEBEZIUM_VERSION}",)
#: Kafka's command-line tools (``kafka-consumer-groups.sh`` runs one of its classes), at the broker's version.
KAFKA_TOOLS_PACKAGES: tuple[str, ...] = (f"org.apache.kafka:kafka-tools:{KAFKA_BROKER_VERSION}",)
#: What ``./replica setup`` caches beside Spark's packages, each under its own name, so that later runs, the tests'
#: included, resolve nothing from the network.
LOCAL_TOOLS: dict[str, tuple[tuple[str, ...], str]] = {
    "kafka-broker": (BROKER_PACKAGES, f"Kafka broker {KAFKA_BROKER_VERSION}"),
    "kafka-tools": (KAFKA_TOOLS_PACKAGES, f"Kafka's tools {KAFKA_BROKER_VERSION}"),
    "kafka-connect": (CONNECT_PACKAGES, f"Kafka Connect {KAFKA_BROKER_VERSION}"),
    "debezium-postgres": (DEBEZIUM_POSTGRES_PACKAGES, f"Debezium's PostgreSQL connector {DEBEZIUM_VERSION}"),
}

RESOURCES = Path(__file__).resolve().parent / "resources"
MIN_JAVA = 17
_RESOLVE_TIMEOUT_S = 900


@dataclass(frozen=True)
class Java:
    """A Java runtime found on this machine."""

    executable: str
    major: int


def find_java(java_home: str | None) -> Java:
    """Locate a Java >= 17 (JAVA_HOME first, then PATH), or say how to get one."""
    candidates = []
    if java_home:
        candidates.append(str(Path(java_home) / "bin" / "java"))
    on_path = shutil.which("java")
    if on_path:
        candidates.append(on_path)
    if not candidates:
        raise SetupError(
            f"no Java found (JAVA_HOME unset and no 'java' on PATH): install Java {MIN_JAVA}+ "
            "(e.g. apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
        )
    exe = candidates[0]
    try:
        out = subprocess.run([exe, "-version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"cannot run {exe} ({exc}): set JAVA_HOME to a Java {MIN_JAVA}+ installation") from exc
    major = parse_java_major(out.stderr + out.stdout)
    if major is None or major < MIN_JAVA:
        raise SetupError(
            f"Java {MIN_JAVA} or newer is required, found {major or 'an unknown version'} at {exe}: "
            f"install openjdk-{MIN_JAVA}-jre-headless or set JAVA_HOME to a newer Java"
        )
    return Java(executable=exe, major=major)


def parse_java_major(version_output: str) -> int | None:
    """The major version from ``java -version`` output (``1.8.0_x`` -> 8, ``17.0.2`` -> 17)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if not match:
        return None
    first = int(match.group(1))
    if first == 1 and match.group(2):
        return int(match.group(2))
    return first


def ivy_jar() -> Path:
    """The Ivy jar shipped inside pyspark (Spark uses it for ``--packages``)."""
    import pyspark

    jars = sorted((Path(pyspark.__file__).parent / "jars").glob("ivy-*.jar"))
    if not jars:
        raise SetupError("pyspark ships no ivy-*.jar: reinstall the project (./replica setup)")
    return jars[-1]


def _ivy_module(coordinates: tuple[str, ...]) -> str:
    deps = []
    for coordinate in coordinates:
        org, name, rev = coordinate.split(":")
        deps.append(f'    <dependency org="{org}" name="{name}" rev="{rev}" conf="default->master,compile,runtime"/>')
    return (
        '<ivy-module version="2.0">\n  <info organisation="replica" module="resolved"/>\n'
        "  <dependencies>\n" + "\n".join(deps) + "\n  </dependencies>\n</ivy-module>\n"
    )


def resolve_jars(java: Java, coordinates: tuple[str, ...], state_dir: Path, name: str) -> list[Path]:
    """Resolve ``coordinates`` with their runtime dependencies into ``<state>/jars/<name>-<hash>``, once."""
    digest = hashlib.sha256("\n".join(coordinates).encode()).hexdigest()[:12]
    target = state_dir / "jars" / f"{name}-{digest}"
    done = target / ".resolved"
    if done.exists():
        return sorted(target.glob("*.jar"))
    target.mkdir(parents=True, exist_ok=True)
    module = target / "ivy.xml"
    module.write_text(_ivy_module(coordinates))
    log = target / "ivy.log"
    logger.info("resolving %s from Maven Central (first run only) ...", ", ".join(coordinates))
    cmd = [
        java.executable,
        "-jar",
        str(ivy_jar()),
        "-settings",
        str(IVY_SETTINGS),
        "-cache",
        str(state_dir / "ivy" / "cache"),
        "-ivy",
        str(module),
        "-confs",
        "default",
        "-retrieve",
        str(target / "[artifact]-[revision](-[classifier]).[ext]"),
    ]
    try:
        with log.open("w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=_RESOLVE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise SetupError(
            f"resolving {name} jars from Maven Central took over {_RESOLVE_TIMEOUT_S}s: check the network "
            f"and retry (log: {log})"
        ) from exc
    if proc.returncode != 0:
        unresolved = [ln.strip() for ln in log.read_text().splitlines() if "not found" in ln or "FAILED" in ln]
        detail = unresolved[0] if unresolved else f"exit code {proc.returncode}"
        raise SetupError(
            f"could not download {name} jars from Maven Central ({detail}): check the network or proxy "
            f"and retry; full log: {log}"
        )
    done.write_text("\n".join(coordinates) + "\n")
    return sorted(target.glob("*.jar"))


def packages_for(job_file: str) -> tuple[str, ...]:
    """The ``--packages`` for a dev job (``spark-submit.sh`` asks): :data:`SPARK_PACKAGES` plus the job's own."""
    return SPARK_PACKAGES + JOB_PACKAGES.get(Path(job_file).name, ())
