"""A Spark standalone cluster on loopback, started from the installed pyspark's own scripts, for tests.

One master and ``workers`` workers (``spark-class org.apache.spark.deploy.master.Master`` and ``…worker.Worker``),
each in its own process group with its output in a file; :meth:`SparkStandalone.executors` finds the executor
JVMs the workers launched, so a test can kill one as a lost machine would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from replica_dev.embedded_kafka import free_port
from replica_lib.errors import ReplicaError

logger = logging.getLogger(__name__)


class ClusterError(ReplicaError):
    """The standalone cluster did not start or answer; says where its log is."""


def _spark_class() -> str:
    return str(Path(sys.executable).parent / "spark-class")


class SparkStandalone:
    """A master and ``workers`` workers on 127.0.0.1, their work folders and logs under ``work_dir``."""

    def __init__(self, work_dir: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.work_dir = work_dir.resolve()
        self.workers, self.cores, self.memory = workers, cores, memory
        self.port, self.ui_port = 0, 0
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _launch(self, name: str, args: list[str]) -> None:
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1"}
        log = (self.work_dir / f"{name}.log").open("ab")
        self._procs.append(
            subprocess.Popen(
                [_spark_class(), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        )
        log.close()

    def start(self, timeout_s: float = 120.0) -> SparkStandalone:
        """Start the master and the workers; returns once every worker is registered and alive."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.port, self.ui_port = free_port(), free_port()
        try:
            self._launch(
                "master",
                [
                    "org.apache.spark.deploy.master.Master",
                    *("--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui_port)),
                ],
            )
            for i in range(1, self.workers + 1):
                work = self.work_dir / f"worker{i}"
                work.mkdir(exist_ok=True)
                self._launch(
                    f"worker{i}",
                    [
                        "org.apache.spark.deploy.worker.Worker",
                        *("--host", "127.0.0.1", "--webui-port", str(free_port())),
                        *("--cores", str(self.cores), "--memory", self.memory, "--work-dir", str(work)),
                        self.master_url,
                    ],
                )
            self._wait_alive(timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("Spark standalone cluster ready at %s (%d workers)", self.master_url, self.workers)
        return self

    def state(self) -> dict[str, object]:
        """The master's own view (its web UI's JSON): workers, applications."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as response:
            return dict(json.load(response))

    def _wait_alive(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise ClusterError(f"a Spark process exited ({proc.returncode}) starting; see {self.work_dir}")
            with contextlib.suppress(OSError, ValueError):
                workers = self.state().get("workers", [])
                alive = (
                    [w for w in workers if isinstance(w, dict) and w.get("state") == "ALIVE"]
                    if isinstance(workers, list)
                    else []
                )
                if len(alive) == self.workers:
                    return
            time.sleep(0.5)  # polling the master until it lists every worker
        raise ClusterError(f"the standalone cluster was not ready within {timeout_s:.0f}s; see {self.work_dir}")

    def executors(self) -> list[int]:
        """Pids of the executor JVMs the workers run now."""
        out = subprocess.run(
            ["pgrep", "-f", "org.apache.spark.executor.CoarseGrainedExecutorBackend"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return [int(pid) for pid in out.split() if _under(int(pid), self.work_dir)]

    def kill_executor(self) -> int:
        """SIGKILL one executor JVM (the worker starts another); returns its pid."""
        pids = self.executors()
        if not pids:
            raise ClusterError("no executor is running on the cluster")
        os.kill(pids[0], signal.SIGKILL)
        logger.info("killed executor pid %d", pids[0])
        return pids[0]

    def stop(self) -> None:
        for proc in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
        self._procs = []

    def __enter__(self) -> SparkStandalone:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _under(pid: int, work_dir: Path) -> bool:
    """Whether executor ``pid`` runs in a work folder of this cluster (its current directory)."""
    try:
        return os.readlink(f"/proc/{pid}/cwd").startswith(str(work_dir))
    except OSError:
        return False
