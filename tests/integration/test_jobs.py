"""The jobs as users run them: through spark-submit.sh, in their own processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality
from pyspark.sql import SparkSession

from replica_dev import loadgen
from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_lib.config import PROJECT_ROOT, load_replica, local_settings
from replica_lib.producer import ChangeProducer
from tests.integration.support import end_offsets, expected_df, replica_df

pytestmark = pytest.mark.integration


class Output:
    """Collects a process's stdout lines on a thread, so tests can wait for a line with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._proc = proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self._proc.poll() is not None and not self._thread.is_alive():
                break
            self._thread.join(0.2)
        raise AssertionError(f"no line containing {text!r} within {timeout_s}s; output:\n" + "\n".join(self.lines))


def test_materialize_job_stops_after_the_current_batch_on_sigterm(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = topic_factory(partitions=80)  # more than the 64 Kafka consumers Spark keeps by default
    with ChangeProducer(connection) as producer:
        log = loadgen.run(producer, topic, loadgen.Workload(keys=400, events=800, seed=3))  # most partitions read
    conf = tmp_path / "sigterm.toml"
    doc = replica_doc(
        "sigterm",
        tmp_path / "data",
        "${REPLICA_BOOTSTRAP_SERVERS}",
        {"orders": orders_table(topic)},
        trigger={"interval": "1 second"},
    )
    write_replica(conf, doc)
    env = {**os.environ, "REPLICA_BOOTSTRAP_SERVERS": connection["bootstrap.servers"]}
    stderr_file = tmp_path / "stderr.log"
    with stderr_file.open("w") as stderr:
        proc = subprocess.Popen(
            [str(PROJECT_ROOT / "spark-submit.sh"), "jobs/materialize.py", str(conf)],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    output = Output(proc)
    try:
        output.wait_for("replica sigterm batch 0:", timeout_s=240)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    output.wait_for("replica sigterm stopped", timeout_s=5)
    assert any("SIGTERM received, stopping after the current batch" in line for line in output.lines)
    # A graceful stop is no error: neither Spark's log nor py4j's nor ours reports one.
    logged = output.lines + stderr_file.read_text().splitlines()
    assert [line for line in logged if " ERROR " in line or "Traceback" in line or "Exception" in line] == []
    # A consumer per partition is kept from batch to batch, not closed and opened again with a warning each time.
    assert [line for line in logged if "InternalKafkaConsumerPool" in line] == []
    # Its JVM started from the class-data archive spark-submit.sh makes once (a refused one is a JVM warning).
    assert list(local_settings().class_archive_dir.glob("spark-*.jsa"))
    assert [line for line in logged if "[cds" in line or "shared archive" in line] == []

    cfg = load_replica(conf, env)
    assert_df_equality(
        replica_df(spark, cfg, "orders"),
        expected_df(spark, cfg, "orders", log),
        ignore_row_order=True,
        ignore_nullable=True,
    )

    # The SQL notebook runs against this replica as it stands.
    notebook = json.loads((PROJECT_ROOT / "notebooks" / "replica_sql.ipynb").read_text())
    namespace: dict[str, Any] = {}
    monkeypatch.setenv("REPLICA_CONF", str(conf))
    monkeypatch.setenv("REPLICA_BOOTSTRAP_SERVERS", connection["bootstrap.servers"])
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "replica_sql.ipynb", "exec"), namespace)
    assert namespace["applied"].offsets == {topic: {p: 0 for p in range(80)} | end_offsets(log)}  # some stay empty
