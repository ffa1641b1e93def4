"""The walking skeleton, end to end on this machine: ./replica demo

Starts a real Kafka broker, creates the ``orders`` topic, runs the demo primary, materializes replica
``orders_a`` with ``spark-submit.sh jobs/materialize.py conf/orders_a.toml``, queries it with SQL, checks it
against the reference model, and stops the broker. Everything lives under ``<state>/demo`` (wiped first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from jobs._cli import guarded, setup_logging
from replica_dev import loadgen
from replica_dev.embedded_kafka import EmbeddedKafka
from replica_dev.model import fold
from replica_lib.config import PROJECT_ROOT, load_replica, local_settings
from replica_lib.errors import ReplicaError
from replica_lib.producer import ChangeProducer
from replica_lib.topics import TopicAdmin, TopicSpec

CONF = PROJECT_ROOT / "conf" / "orders_a.toml"
COLUMNS = ("order_id", "customer", "amount", "status", "updated_ms")


class _Steps:
    def __init__(self, total: int) -> None:
        self.total, self.n, self.started = total, 0, time.monotonic()

    def __call__(self, text: str) -> None:
        self.n += 1
        print(f"\n[{self.n}/{self.total}] {text}  (t+{time.monotonic() - self.started:.0f}s)", flush=True)


def _submit(args: list[str], env: dict[str, str], log: Path) -> None:
    """Run ``spark-submit.sh``: the job's own output is shown, Spark's and Ivy's go to ``log``."""
    cmd = [str(PROJECT_ROOT / "spark-submit.sh"), *args]
    with log.open("a") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(":: loading settings"):  # Ivy's banner
                continue
            print(f"    {line.rstrip()}", flush=True)
        code = proc.wait()
    if code != 0:
        raise ReplicaError(f"{' '.join(args[:2])} failed with exit code {code}; Spark's log: {log}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="demo", description="Run the replica walking skeleton end to end.")
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--events", type=int, default=2000)
    args = parser.parse_args(argv)
    setup_logging()
    settings = local_settings()
    sandbox = settings.state_dir / "demo"

    def body() -> int:
        step = _Steps(6)
        shutil.rmtree(sandbox, ignore_errors=True)
        sandbox.mkdir(parents=True)
        step("starting a Kafka broker (KRaft, single node, loopback)")
        with EmbeddedKafka(sandbox / "broker", settings.state_dir, settings.java_home) as broker:
            print(f"    broker at {broker.bootstrap_servers}, data in {broker.data_dir}")
            connection = {"bootstrap.servers": broker.bootstrap_servers}

            step("creating topic 'orders' (compacted, 3 partitions)")
            report = TopicAdmin(connection).ensure(TopicSpec.local("orders", partitions=3), local=True)
            for finding in report.findings:
                print(f"    {finding}")

            step(f"demo primary: writing {args.events} changes over {args.keys} orders")
            workload = loadgen.Workload(keys=args.keys, events=args.events)
            with ChangeProducer(connection) as producer:
                logged = loadgen.run(producer, "orders", workload)
            ops = {op: sum(1 for e in logged if e.change.op == op) for op in ("upsert", "delete")}
            print(
                f"    acknowledged {len(logged)} changes ({ops['upsert']} upserts, {ops['delete']} deletes), "
                f"last at {logged[-1].position}"
            )

            env = {
                **os.environ,
                "REPLICA_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
                "REPLICA_DATA_DIR": str(sandbox / "data"),
            }
            log = sandbox / "spark.log"
            step("materializing replica orders_a: ./spark-submit.sh jobs/materialize.py conf/orders_a.toml")
            _submit(["jobs/materialize.py", str(CONF), "--available-now"], env, log)

            step("querying the replica with SQL: ./replica sql conf/orders_a.toml ...")
            rows_file = sandbox / "orders.jsonl"
            _submit(
                [
                    "jobs/sql.py",
                    str(CONF),
                    "SELECT status, count(*) AS orders, round(sum(amount), 2) AS total FROM orders "
                    "GROUP BY status ORDER BY status",
                    f"SELECT {', '.join(COLUMNS)} FROM orders ORDER BY order_id",
                    "--limit",
                    "5",
                    "--output",
                    str(rows_file),
                ],
                env,
                log,
            )

            step("checking the replica against the reference model (fold of the log per key)")
            cfg = load_replica(CONF, env)
            expected = fold(logged, {"orders": cfg.table("orders").keys}, {"orders": True})["orders"]
            actual = {}
            for line in rows_file.read_text().splitlines():
                row = json.loads(line)
                actual[(row["order_id"],)] = {c: row[c] for c in COLUMNS}
            wanted = {k: {c: v[c] for c in COLUMNS} for k, v in expected.items()}
            missing = wanted.keys() - actual.keys()
            extra = actual.keys() - wanted.keys()
            different = [k for k in wanted.keys() & actual.keys() if wanted[k] != actual[k]]
            print(
                f"    primary has {len(wanted)} live orders, replica has {len(actual)}: {len(missing)} missing, "
                f"{len(extra)} extra, {len(different)} different"
            )
            print("\nstopping the broker")
        if missing or extra or different:
            print("FAILED: the replica differs from the primary", file=sys.stderr)
            return 1
        print(
            f"done in {time.monotonic() - step.started:.0f}s: replica orders_a equals the primary. "
            f"Tables and logs are in {sandbox}"
        )
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
