"""The SQL endpoint: Spark's Thrift server (HiveThriftServer2) over the catalog, and beeline to talk to it.

The server runs in the driver of ``jobs/serve.py``, started on that driver's own session
(``HiveThriftServer2.startWithSparkSession``), so the session is built where every session is
(:mod:`replica_lib.session`) and the replicas' names are registered by the same code as everywhere
(:mod:`replica_lib.catalog`). It answers the HiveServer2 protocol (JDBC ``jdbc:hive2://host:port/default``, ODBC,
beeline, BI tools) with the server's warm JVM. While it runs it holds the local catalog, and a file
``<catalog>/sql-server.json`` says where it is, so ``./replica sql`` sends its queries there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.sql import SparkSession

from replica_lib.config import LocalSettings
from replica_lib.errors import SetupError

SERVER_FILE = "sql-server.json"
THRIFT_SERVER = "org.apache.spark.sql.hive.thriftserver.HiveThriftServer2"
#: What the server's JDBC sessions must load from the JVM's own class path: Hive builds each session's class loader
#: on it, not on the loader that ``--packages`` fills, so spark-submit.sh puts Delta's jars there for this job.
SESSION_CLASS = "org.apache.spark.sql.delta.catalog.DeltaCatalog"


@dataclass(frozen=True)
class ServerInfo:
    """A running SQL server: its driver's pid and its address."""

    pid: int
    host: str
    port: int

    @property
    def url(self) -> str:
        return self.url_for("default")

    def url_for(self, database: str) -> str:
        """The JDBC URL of a session whose current database is ``database``."""
        return f"jdbc:hive2://{self.host}:{self.port}/{database}"


def server_file(settings: LocalSettings) -> Path:
    return settings.catalog_home / SERVER_FILE


def thrift_conf(host: str, port: int) -> dict[str, str]:
    """The session settings of a server listening on ``host:port``."""
    return {
        "spark.hadoop.hive.server2.thrift.bind.host": host,
        "spark.hadoop.hive.server2.thrift.port": str(port),
        "spark.sql.hive.thriftServer.singleSession": "false",
        # How long the server's stop waits for its connection threads (Hive's default, 60 s, held every stop up).
        "spark.hadoop.hive.server2.thrift.worker.keepalive.time": "5s",
    }


def start_thrift_server(spark: SparkSession) -> Any:
    """Start Spark's Thrift server on ``spark`` (settings of :func:`thrift_conf`); returns it (``stop()`` stops it)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    try:
        jvm.java.lang.ClassLoader.getSystemClassLoader().loadClass(SESSION_CLASS)
    except Py4JJavaError as exc:  # ClassNotFoundException
        raise SetupError(
            "Delta's jars are not on the server's class path (a first run downloads them): run ./replica setup, "
            "then start the server again"
        ) from exc
    server_class = getattr(jvm.org.apache.spark.sql.hive.thriftserver, "HiveThriftServer2$")
    return getattr(server_class, "MODULE$").startWithSparkSession(spark._jsparkSession, False)


def write_server_file(settings: LocalSettings, info: ServerInfo) -> None:
    path = server_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"pid": info.pid, "host": info.host, "port": info.port}))
    partial.rename(path)


def remove_server_file(settings: LocalSettings, pid: int) -> None:
    """Remove the server file if it is ``pid``'s (a server started since keeps its own)."""
    info = _read(server_file(settings))
    if info is not None and info.pid == pid:
        with contextlib.suppress(FileNotFoundError):
            server_file(settings).unlink()


def _read(path: Path) -> ServerInfo | None:
    try:
        body = json.loads(path.read_text())
        return ServerInfo(int(body["pid"]), str(body["host"]), int(body["port"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a process that exited but was not yet reaped by its parent does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: the signal's answer stands
    return state not in ("Z", "X")


def running_server(settings: LocalSettings) -> ServerInfo | None:
    """The server of this catalog if one runs and accepts connections; a file left by a dead one is ignored."""
    info = _read(server_file(settings))
    if info is None or not alive(info.pid):
        return None
    try:
        with socket.create_connection((info.host, info.port), timeout=2):
            return info
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- beeline
def beeline_path() -> Path:
    """The beeline that pyspark ships (``pyspark/bin/beeline``)."""
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "beeline"


@dataclass(frozen=True)
class BeelineResult:
    returncode: int
    output: str  # the rows, as beeline printed them
    error: str | None  # one line saying why it failed, or None


_PROMPT = re.compile(r"^\d+: jdbc:hive2://\S*> ", re.M)


def beeline(url: str, sql: str, output_format: str = "table", timeout_s: float = 600.0) -> BeelineResult:
    """Run ``sql`` (statements separated by ``;``) through beeline against ``url``."""
    import pyspark

    env = {**os.environ, "SPARK_HOME": str(Path(pyspark.__file__).parent)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        [str(beeline_path()), "-u", url, "--silent=true", f"--outputformat={output_format}", "-e", sql],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        timeout=timeout_s,
        check=False,
    )
    output = _PROMPT.sub("", proc.stdout)
    error = None if proc.returncode == 0 else error_line(proc.stderr)
    return BeelineResult(proc.returncode, output, error)


def error_line(stderr: str) -> str:
    """The one line that says why a beeline statement failed (Spark's error class and message, not the trace)."""
    start = stderr.find("Error: ")
    if start < 0:
        lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        return lines[-1].strip() if lines else "beeline failed"
    block = stderr[start + len("Error: ") :]
    for end in ("\n\tat ", "\n== SQL ==", "\nCaused by"):
        cut = block.find(end)
        if cut >= 0:
            block = block[:cut]
    marker = block.rfind("Exception: ")
    if marker >= 0:
        block = block[marker + len("Exception: ") :]
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    return re.sub(r" \(state=\S*,code=\S*\)$", "", lines[0]) if lines else "beeline failed"
