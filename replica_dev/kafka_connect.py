"""A real Kafka Connect worker (standalone mode) with Debezium's PostgreSQL connector, for tests.

Production never uses this: Debezium runs on the user's own Connect cluster. Here the worker runs from Maven Central
artifacts resolved by Ivy into the project's cache (:mod:`replica_dev.maven`): Apache Kafka's ``connect-runtime`` and
``connect-json`` of the embedded broker's version on the class path, and Debezium's connector on ``plugin.path``, in
a class loader of its own as on any Connect cluster. The worker's JSON converters send schemas with every record
(what the replica reads logical types from; see the README's "Debezium settings"). Its REST API on loopback
creates connectors and reports their state and committed offsets (:class:`ConnectClient`).

The worker JVM is killed by the kernel if this process dies (``PR_SET_PDEATHSIG``); :meth:`KafkaConnect.stop` or
the context manager stops it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from replica_dev import maven
from replica_dev.embedded_kafka import die_with, free_port
from replica_dev.polling import wait_for
from replica_lib.errors import ConnectError

logger = logging.getLogger(__name__)

_REST_TIMEOUT_S = 30.0


def _worker_properties(data_dir: Path, bootstrap: str, rest_port: int, plugins: Path) -> str:
    settings = {
        "bootstrap.servers": bootstrap,
        "listeners": f"http://127.0.0.1:{rest_port}",
        "key.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "key.converter.schemas.enable": "true",
        "value.converter.schemas.enable": "true",
        "offset.storage.file.filename": str(data_dir / "connect.offsets"),
        # Committed offsets are how a test knows that every change up to a transaction reached Kafka.
        "offset.flush.interval.ms": "500",
        "plugin.path": str(plugins),
        # Plugins declare themselves in ServiceLoader manifests: no scan of every class on the path (seconds).
        "plugin.discovery": "service_load",
    }
    return "".join(f"{key}={value}\n" for key, value in settings.items())


class ConnectClient:
    """Kafka Connect's REST API: create connectors, read their state and committed offsets, wait on them."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """One REST call; the decoded JSON answer (None when empty). Raises :class:`ConnectError` on an error status."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        req.add_header("Accept", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=_REST_TIMEOUT_S) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise ConnectError(f"Kafka Connect answered {method} {path} with {exc.code}: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ConnectError(f"Kafka Connect at {self.url} did not answer {method} {path}: {exc}") from exc
        return json.loads(text) if text.strip() else None

    def put_connector(self, name: str, config: Mapping[str, str]) -> None:
        """Create the connector ``name`` with ``config`` (or change its config)."""
        self.request("PUT", f"/connectors/{name}/config", dict(config))

    def delete_connector(self, name: str) -> None:
        self.request("DELETE", f"/connectors/{name}")

    def status(self, name: str) -> dict[str, Any]:
        answer: dict[str, Any] = self.request("GET", f"/connectors/{name}/status")
        return answer

    def offsets(self, name: str) -> list[dict[str, Any]]:
        """The connector's committed source offsets: ``[{"partition": {...}, "offset": {...}}, ...]``."""
        answer = self.request("GET", f"/connectors/{name}/offsets")
        return list(answer.get("offsets", [])) if answer else []

    def wait_running(self, name: str, timeout_s: float = 120.0) -> None:
        """Wait until the connector and all its tasks (at least one) run; a failed one raises with its error."""

        def running() -> bool:
            try:
                state = self.status(name)
            except ConnectError:
                return False  # not created yet, or the worker is busy creating it
            parts = [("connector", state["connector"]), *((f"task {t['id']}", t) for t in state.get("tasks", []))]
            for what, part in parts:
                if part["state"] == "FAILED":
                    trace = str(part.get("trace", "")).strip().splitlines()
                    raise ConnectError(f"connector {name}: {what} failed: {trace[0] if trace else 'no trace'}")
            return len(parts) > 1 and all(part["state"] == "RUNNING" for _, part in parts)

        wait_for(running, timeout_s, f"connector {name} to run", ConnectError)

    def wait_offset(self, name: str, reached: Callable[[dict[str, Any]], bool], timeout_s: float = 120.0) -> None:
        """Wait until a committed offset of the connector satisfies ``reached``; a failed task raises."""

        def done() -> bool:
            self.wait_running(name, timeout_s)
            return any(reached(entry["offset"]) for entry in self.offsets(name))

        wait_for(done, timeout_s, f"connector {name} to commit the offset awaited", ConnectError)


class KafkaConnect:
    """One standalone Connect worker with Debezium's PostgreSQL connector, its files in ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        state_dir: Path,
        bootstrap_servers: str,
        java_home: str | None = None,
        start_timeout_s: float = 120.0,
        heap: str = "512m",
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.state_dir = state_dir
        self.bootstrap_servers = bootstrap_servers
        self.java_home = java_home
        self.start_timeout_s = start_timeout_s
        self.heap = heap
        self.rest_port = 0
        self.started_in_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def client(self) -> ConnectClient:
        if not self.rest_port:
            raise ConnectError("the Connect worker has not been started: call start() first")
        return ConnectClient(f"http://127.0.0.1:{self.rest_port}")

    def start(self) -> KafkaConnect:
        """Start the worker and wait until its REST API lists the PostgreSQL connector's plugin."""
        began = time.monotonic()
        java = maven.find_java(self.java_home)
        runtime = maven.resolve_jars(java, maven.CONNECT_PACKAGES, self.state_dir, "kafka-connect")
        plugin = maven.resolve_jars(java, maven.DEBEZIUM_POSTGRES_PACKAGES, self.state_dir, "debezium-postgres")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        plugins = self.data_dir / "plugins"
        plugins.mkdir(exist_ok=True)
        link = plugins / "debezium-connector-postgres"
        if not link.exists():
            link.symlink_to(plugin[0].parent, target_is_directory=True)
        self.rest_port = free_port()
        props = self.data_dir / "worker.properties"
        props.write_text(_worker_properties(self.data_dir, self.bootstrap_servers, self.rest_port, plugins))
        cmd = [
            java.executable,
            f"-Xmx{self.heap}",
            "-XX:+UseG1GC",
            "-XX:TieredStopAtLevel=1",  # a test worker lives a minute or two: start fast rather than peak
            f"-Dreplica.connect.dir={self.data_dir}",
            f"-Dlog4j2.configurationFile={maven.RESOURCES / 'log4j2-connect.properties'}",
            "-Djava.awt.headless=true",
            "-cp",
            ":".join(str(jar) for jar in runtime),
            "org.apache.kafka.connect.cli.ConnectStandalone",
            str(props),
        ]
        out = (self.data_dir / "connect.out").open("ab")
        self._proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with(os.getpid())
        )
        out.close()
        try:
            wait_for(
                self._ready,
                self.start_timeout_s,
                f"Kafka Connect to start (log: {self.data_dir / 'connect.log'})",
                ConnectError,
            )
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - began
        logger.info(
            "Kafka Connect %s with Debezium %s ready at %s in %.1f s (pid %d)",
            maven.KAFKA_BROKER_VERSION,
            maven.DEBEZIUM_VERSION,
            self.client.url,
            self.started_in_s,
            self._proc.pid,
        )
        return self

    def _ready(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise ConnectError(
                f"the Kafka Connect worker exited with code {self._proc.returncode} while starting "
                f"(log: {self.data_dir / 'connect.log'}, {self.data_dir / 'connect.out'})"
            )
        try:
            plugins = self.client.request("GET", "/connector-plugins")
        except ConnectError:
            return False
        return any(p.get("class") == "io.debezium.connector.postgresql.PostgresConnector" for p in plugins)

    def stop(self) -> None:
        """Stop the worker (SIGTERM: it stops its connectors and commits their offsets), SIGKILL after 30 s."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=30)

    def __enter__(self) -> KafkaConnect:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
