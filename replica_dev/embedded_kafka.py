"""A real Apache Kafka broker (KRaft, single node) on loopback, for local use and tests.

Production never uses this: replicas are configured with bootstrap servers. Here the broker runs from the
Maven Central artifacts (see :mod:`replica_lib.artifacts`) with its data in a folder of the caller's choice.

Two ways to own a broker:

* attached (tests, the demo): the JVM is killed by the kernel if its parent dies (``PR_SET_PDEATHSIG``), and
  :meth:`EmbeddedKafka.stop` or the context manager stops it;
* detached (``./replica broker start``): it outlives the command; ``./replica broker stop`` ends it.

Every broker JVM carries ``-Dreplica.broker.dir=<data dir>`` and ``-Dreplica.broker.owner=<pid or 0>``, so
brokers left behind by crashed runs are found (:func:`find_brokers`) and cleaned (:func:`clean_orphans`).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from replica_dev import maven
from replica_lib.errors import BrokerError, SetupError
from replica_lib.server import alive

logger = logging.getLogger(__name__)

_DIR_PROP = "-Dreplica.broker.dir="
_OWNER_PROP = "-Dreplica.broker.owner="
_STATE_FILE = "broker.json"
_PR_SET_PDEATHSIG = 1
PLAIN_LOGIN_MODULE = "org.apache.kafka.common.security.plain.PlainLoginModule"
_INTERNAL_USER = "broker"


@dataclass(frozen=True)
class BrokerProcess:
    """A broker JVM found running on this machine."""

    pid: int
    data_dir: Path
    owner_pid: int  # 0 for a detached broker

    @property
    def orphaned(self) -> bool:
        return self.owner_pid != 0 and not alive(self.owner_pid)


def find_brokers() -> list[BrokerProcess]:
    """Every embedded broker JVM on this machine, whoever started it."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        data_dir = owner = None
        for arg in args:
            text = arg.decode(errors="replace")
            if text.startswith(_DIR_PROP):
                data_dir = Path(text[len(_DIR_PROP) :])
            elif text.startswith(_OWNER_PROP):
                owner = int(text[len(_OWNER_PROP) :])
        if data_dir is not None and owner is not None:
            found.append(BrokerProcess(pid=int(proc.name), data_dir=data_dir, owner_pid=owner))
    return found


def clean_orphans() -> list[BrokerProcess]:
    """Kill brokers whose owning process has died (a crashed test run or demo); returns what was killed."""
    killed = []
    for broker in find_brokers():
        if broker.orphaned:
            logger.warning(
                "stopping an orphaned Kafka broker (pid %d, data %s) left by a run that died",
                broker.pid,
                broker.data_dir,
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(broker.pid, signal.SIGKILL)
            killed.append(broker)
    return killed


def new_cluster_id() -> str:
    """A random KRaft cluster id (base64url of a UUID), never starting with ``-``.

    Kafka's own ``Uuid.randomUuid`` skips those too: the storage tool's argument parser takes ``-t -abc…`` for
    an option, and formatting fails (1 start in 64 before this).
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_free(port: int) -> bool:
    """Whether the broker could listen on ``port``.

    The JVM binds its listeners with ``SO_REUSEADDR``, so connections of a just-stopped broker lingering in
    TIME_WAIT do not block it; the probe must do the same, or a restart on the same port is refused.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _accepts_connections(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def die_with(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when ``parent_pid`` dies (Linux ``PR_SET_PDEATHSIG``)."""

    def arm() -> None:  # pragma: no cover - runs in the child between fork and exec
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def _jaas_quote(value: str) -> str:
    """``value`` as a quoted JAAS option value (Kafka's parser takes backslash escapes inside quotes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _sasl_properties(port: int, users: Mapping[str, str], internal: tuple[str, str]) -> dict[str, str]:
    """Broker settings for a SASL_PLAINTEXT client listener with PLAIN and these users.

    The controller listener stays PLAINTEXT (loopback, the broker's own quorum); brokers talk to each other on
    the SASL listener as the internal user, so no listener takes a client without credentials.
    """
    name, password = internal
    entries = " ".join(f"user_{user}={_jaas_quote(secret)}" for user, secret in {**users, name: password}.items())
    jaas = f"{PLAIN_LOGIN_MODULE} required username={_jaas_quote(name)} password={_jaas_quote(password)} {entries};"
    return {
        "listeners": f"SASL_PLAINTEXT://127.0.0.1:{port}",
        "advertised.listeners": f"SASL_PLAINTEXT://127.0.0.1:{port}",
        "listener.security.protocol.map": "SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "SASL_PLAINTEXT",
        "sasl.enabled.mechanisms": "PLAIN",
        "sasl.mechanism.inter.broker.protocol": "PLAIN",
        # A properties file reads a backslash as an escape: double it so the JAAS text arrives as written.
        "listener.name.sasl_plaintext.plain.sasl.jaas.config": jaas.replace("\\", "\\\\"),
    }


def _server_properties(
    data_dir: Path,
    port: int,
    controller_port: int,
    overrides: Mapping[str, str] | None = None,
    sasl: Mapping[str, str] | None = None,
) -> str:
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir / "log"),
        # One node: internal topics cannot be replicated, and few partitions make start-up fast.
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
        # A node restarted after a kill is let in once its previous registration's session has expired: 2 s, not
        # Kafka's 9 (a restart after a kill took 14 s with the default, 6 s with this).
        "broker.session.timeout.ms": "2000",
        "broker.heartbeat.interval.ms": "500",
        **(sasl or {}),
        **(overrides or {}),
    }
    if sasl:  # the client listener is the SASL one; the controller's stays as it is
        settings["listeners"] = f"{sasl['listeners']},CONTROLLER://127.0.0.1:{controller_port}"
    return "".join(f"{key}={value}\n" for key, value in settings.items())


class EmbeddedKafka:
    """One single-node KRaft broker with its data in ``data_dir``; a context manager for tests.

    ``properties`` override broker settings (``server.properties`` keys), e.g. to mimic a cluster's defaults.
    ``sasl_users`` (user -> password) makes the client listener SASL_PLAINTEXT with the PLAIN mechanism, open to
    those users only; by default it is PLAINTEXT. The passwords are in ``server.properties`` in ``data_dir``, as in
    any broker's JAAS configuration, and nowhere else the broker writes.
    """

    def __init__(
        self,
        data_dir: Path,
        state_dir: Path,
        java_home: str | None = None,
        port: int | None = None,
        start_timeout_s: float = 90.0,
        heap: str = "512m",
        properties: Mapping[str, str] | None = None,
        sasl_users: Mapping[str, str] | None = None,
        cluster_id: str | None = None,
        controller_port: int | None = None,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.cluster_id = cluster_id  # a node of a cluster shares its cluster's; None: a new one when formatting
        self.state_dir = state_dir
        self.java_home = java_home
        self.requested_port = port
        self.start_timeout_s = start_timeout_s
        self.heap = heap
        self.properties = dict(properties or {})
        self.sasl_users = dict(sasl_users or {})
        if any(user == _INTERNAL_USER or not user.isidentifier() for user in self.sasl_users):
            raise BrokerError(
                f"SASL user names must be plain names other than {_INTERNAL_USER!r}: {sorted(self.sasl_users)}"
            )
        if any("\n" in secret or "\r" in secret for secret in self.sasl_users.values()):
            raise BrokerError("a SASL password must be one line")
        self._internal = (_INTERNAL_USER, uuid.uuid4().hex)  # the broker's own user, for inter-broker requests
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.controller_port = controller_port or 0

    # ----------------------------------------------------------------- life cycle
    @property
    def bootstrap_servers(self) -> str:
        if not self.port:
            raise BrokerError("the broker has not been started: call start() first")
        return f"127.0.0.1:{self.port}"

    @property
    def security_protocol(self) -> str:
        return "SASL_PLAINTEXT" if self.sasl_users else "PLAINTEXT"

    def client_config(self, user: str | None = None) -> dict[str, str]:
        """A confluent-kafka (librdkafka) configuration for this broker, as ``user`` (default: the first user)."""
        conf = {"bootstrap.servers": self.bootstrap_servers}
        if self.sasl_users:
            name = user or next(iter(self.sasl_users))
            password = self._internal[1] if name == _INTERNAL_USER else self.sasl_users[name]
            conf.update(
                {
                    "security.protocol": "SASL_PLAINTEXT",
                    "sasl.mechanisms": "PLAIN",
                    "sasl.username": name,
                    "sasl.password": password,
                }
            )
        return conf

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, detach: bool = False, wait: bool = True) -> EmbeddedKafka:
        """Start the broker and wait until it answers; raises :class:`BrokerError` within the timeout.

        ``wait`` False returns once the process runs: a node of a cluster answers only when a quorum of its
        controllers runs, so :class:`KafkaCluster` starts them all before it waits (:meth:`wait_ready`).
        """
        clean_orphans()
        for other in find_brokers():
            if other.data_dir == self.data_dir:
                raise BrokerError(
                    f"a broker already runs on {self.data_dir} (pid {other.pid}): stop it first "
                    "(./replica broker stop) or use another data folder"
                )
        java = maven.find_java(self.java_home)
        jars = maven.resolve_jars(java, maven.BROKER_PACKAGES, self.state_dir, "kafka-broker")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._choose_ports()
        props = self.data_dir / "server.properties"
        sasl = _sasl_properties(self.port, self.sasl_users, self._internal) if self.sasl_users else None
        props.touch(mode=0o600)  # it may hold the SASL users' passwords
        props.write_text(_server_properties(self.data_dir, self.port, self.controller_port, self.properties, sasl))
        classpath = ":".join(str(jar) for jar in jars)
        base = [
            java.executable,
            f"{_DIR_PROP}{self.data_dir}",
            f"{_OWNER_PROP}{0 if detach else os.getpid()}",
            f"-Dlog4j2.configurationFile={maven.RESOURCES / 'log4j2-broker.properties'}",
            "-Djava.awt.headless=true",
        ]
        if not (self.data_dir / "log" / "meta.properties").exists():
            self._format(base, classpath, props)
        cmd = [*base, f"-Xmx{self.heap}", "-XX:+UseG1GC", "-cp", classpath, "kafka.Kafka", str(props)]
        out = (self.data_dir / "broker.out").open("ab")
        self._proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=detach,
            preexec_fn=None if detach else die_with(os.getpid()),
        )
        out.close()
        self._write_state(detach)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Wait until the started broker answers; kills it and raises :class:`BrokerError` if it does not."""
        assert self._proc is not None
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        logger.info(
            "Kafka %s broker ready at %s (pid %d)",
            maven.KAFKA_BROKER_VERSION,
            self.bootstrap_servers,
            self._proc.pid,
        )

    def _choose_ports(self) -> None:
        state = self.read_state(self.data_dir)
        if self.requested_port is not None:
            port = self.requested_port
        elif state and not self.port:
            port = int(str(state["port"]))  # a restart keeps its address
        else:
            port = self.port or free_port()
        controller = self.controller_port or (int(str(state["controller_port"])) if state else free_port())
        for what, number in (("broker", port), ("controller", controller)):
            if not _port_free(number):
                raise BrokerError(
                    f"{what} port {number} on 127.0.0.1 is already in use: stop what listens there or "
                    "choose another port (--port)"
                )
        self.port, self.controller_port = port, controller

    def _format(self, base: list[str], classpath: str, props: Path) -> None:
        cmd = [
            *base,
            "-Xmx256m",
            "-cp",
            classpath,
            "kafka.tools.StorageTool",
            "format",
            "-t",
            self.cluster_id or new_cluster_id(),
            "-c",
            str(props),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except subprocess.TimeoutExpired as exc:
            raise BrokerError(f"formatting the broker storage in {self.data_dir} took over 120s") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise BrokerError(f"formatting broker storage in {self.data_dir} failed: {' | '.join(tail)}")

    def _wait_ready(self) -> None:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + self.start_timeout_s
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerError(
                    f"the Kafka broker exited with code {self._proc.returncode} while starting: "
                    f"{self._log_tail()} (full log: {self.data_dir / 'server.log'})"
                )
            if _accepts_connections(self.port):
                conf: dict[str, Any] = {**self.client_config(_INTERNAL_USER if self.sasl_users else None)}
                admin = AdminClient(conf)
                try:
                    admin.list_topics(timeout=5)
                    return
                except Exception:
                    logger.debug("broker not ready yet", exc_info=True)
            time.sleep(0.2)
        raise BrokerError(
            f"the Kafka broker did not answer within {self.start_timeout_s:.0f}s: {self._log_tail()} "
            f"(full log: {self.data_dir / 'server.log'})"
        )

    def _log_tail(self) -> str:
        for name in ("broker.out", "server.log"):
            path = self.data_dir / name
            if path.exists():
                lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
                errors = [ln for ln in lines if "ERROR" in ln or "Exception" in ln]
                if errors or lines:
                    return (errors or lines)[-1][:400]
        return "no log output"

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop gracefully (SIGTERM), then SIGKILL if it does not exit in time."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = None
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("broker pid %d ignored SIGTERM for %.0fs; killing it", self._proc.pid, timeout_s)
            self.kill()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the broker (a crash, for fault tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)
        self._proc = None

    def restart(self) -> None:
        """Stop and start again on the same data and ports."""
        self.stop()
        self.start()

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether the broker answers a metadata request within ``timeout_s``."""
        return probe(self.bootstrap_servers, timeout_s, self.client_config(_INTERNAL_USER if self.sasl_users else None))

    def __enter__(self) -> EmbeddedKafka:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ----------------------------------------------------------------- detached brokers
    def _write_state(self, detach: bool) -> None:
        assert self._proc is not None
        state = {
            "pid": self._proc.pid,
            "port": self.port,
            "controller_port": self.controller_port,
            "bootstrap_servers": self.bootstrap_servers,
            "detached": detach,
            "kafka_version": maven.KAFKA_BROKER_VERSION,
        }
        (self.data_dir / _STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    @staticmethod
    def read_state(data_dir: Path) -> dict[str, object] | None:
        path = data_dir / _STATE_FILE
        if not path.exists():
            return None
        data: dict[str, object] = json.loads(path.read_text())
        return data


def running_broker(data_dir: Path) -> tuple[BrokerProcess, str] | None:
    """The broker running on ``data_dir`` and its bootstrap servers, if there is one."""
    data_dir = data_dir.resolve()
    for broker in find_brokers():
        if broker.data_dir == data_dir:
            state = EmbeddedKafka.read_state(data_dir) or {}
            return broker, str(state.get("bootstrap_servers", "unknown"))
    return None


def stop_detached(data_dir: Path, timeout_s: float = 30.0) -> BrokerProcess | None:
    """Stop the broker running on ``data_dir`` (started by ``./replica broker start``)."""
    found = running_broker(data_dir)
    if found is None:
        return None
    broker, _ = found
    os.kill(broker.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive(broker.pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(broker.pid, os.WNOHANG)
        time.sleep(0.2)
    if alive(broker.pid):
        os.kill(broker.pid, signal.SIGKILL)
    return broker


def probe(bootstrap_servers: str, timeout_s: float, config: Mapping[str, str] | None = None) -> bool:
    """Whether a Kafka cluster at ``bootstrap_servers`` answers a metadata request in time.

    ``config``: further librdkafka settings (e.g. SASL credentials) for the request.
    """
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**(config or {}), "bootstrap.servers": bootstrap_servers, "log_level": 0})
    try:
        admin.list_topics(timeout=timeout_s)
    except Exception:
        return False
    return True


__all__ = [
    "BrokerProcess",
    "EmbeddedKafka",
    "SetupError",
    "clean_orphans",
    "find_brokers",
    "free_port",
    "probe",
    "running_broker",
    "stop_detached",
]


class KafkaCluster:
    """``nodes`` KRaft nodes on loopback, each a broker and a controller of one quorum, for durability tests.

    Internal topics are replicated to every node; topics default to replication factor 3 and
    ``min.insync.replicas`` 2 (the settings the design asks of production), and unclean leader election is off.
    Node ids are 1..``nodes``; each node keeps its ports across :meth:`EmbeddedKafka.kill` and ``start``.
    """

    def __init__(
        self, data_dir: Path, state_dir: Path, nodes: int = 3, java_home: str | None = None, heap: str = "384m"
    ) -> None:
        if nodes < 3:
            raise BrokerError("a cluster needs at least 3 nodes (a quorum that survives one loss)")
        ports = [(free_port(), free_port()) for _ in range(nodes)]
        voters = ",".join(f"{i}@127.0.0.1:{controller}" for i, (_, controller) in enumerate(ports, start=1))
        cluster_id = new_cluster_id()
        replicated = {
            "controller.quorum.voters": voters,
            "offsets.topic.replication.factor": "3",
            "transaction.state.log.replication.factor": "3",
            "transaction.state.log.min.isr": "2",
            "share.coordinator.state.topic.replication.factor": "3",
            "share.coordinator.state.topic.min.isr": "2",
            "default.replication.factor": "3",
            "min.insync.replicas": "2",
            "unclean.leader.election.enable": "false",
            # A dead node is fenced (and its partitions led by others) after 4 s without a heartbeat, not 9.
            "broker.session.timeout.ms": "4000",
            "broker.heartbeat.interval.ms": "1000",
        }
        self.nodes = [
            EmbeddedKafka(
                data_dir / f"node{i}",
                state_dir,
                java_home=java_home,
                port=port,
                heap=heap,
                properties={**replicated, "node.id": str(i)},
                cluster_id=cluster_id,
                controller_port=controller,
            )
            for i, (port, controller) in enumerate(ports, start=1)
        ]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.bootstrap_servers for node in self.nodes)

    def node(self, node_id: int) -> EmbeddedKafka:
        return self.nodes[node_id - 1]

    def start(self) -> KafkaCluster:
        """Start every node, then wait until each answers."""
        try:
            for node in self.nodes:
                node.start(wait=False)
            for node in self.nodes:
                node.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def leader(self, topic: str, partition: int, timeout_s: float = 30.0) -> int:
        """The node id leading ``partition`` of ``topic`` (asked of any node that answers)."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = ",".join(n.bootstrap_servers for n in self.nodes if n.pid is not None)
            metadata = AdminClient({"bootstrap.servers": live}).list_topics(topic, timeout=10)
            leader = metadata.topics[topic].partitions[partition].leader
            if leader > 0:
                return int(leader)
            time.sleep(0.2)  # polling the cluster's metadata until it names a leader
        raise BrokerError(f"no leader for {topic} partition {partition} within {timeout_s:.0f}s")

    def stop(self) -> None:
        """Stop every node; one that cannot shut down cleanly (its quorum lost) is killed after 10 s."""
        for node in self.nodes:
            node.stop(timeout_s=10.0)

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
