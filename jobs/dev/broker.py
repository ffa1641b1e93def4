"""The embedded Kafka broker for local use: ./replica broker start|stop|status [--port N]"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import guarded, setup_logging
from replica_dev.embedded_kafka import EmbeddedKafka, clean_orphans, find_brokers, probe, running_broker, stop_detached
from replica_lib.config import local_settings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="broker", description="Start, stop or check the local Kafka broker.")
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--port", type=int, help="listen on this port (default: a free one, kept across restarts)")
    args = parser.parse_args(argv)
    setup_logging()
    settings = local_settings()
    data_dir = settings.broker_dir

    def body() -> int:
        if args.action == "start":
            found = running_broker(data_dir)
            if found:
                print(f"already running: pid {found[0].pid}, bootstrap servers {found[1]}")
                return 0
            broker = EmbeddedKafka(data_dir, settings.state_dir, settings.java_home, port=args.port)
            broker.start(detach=True)
            print(f"Kafka broker running: pid {broker.pid}, bootstrap servers {broker.bootstrap_servers}")
            print(f"  export REPLICA_BOOTSTRAP_SERVERS={broker.bootstrap_servers}")
            print(f"  data and logs: {data_dir}")
            return 0
        if args.action == "stop":
            stopped = stop_detached(data_dir)
            print(f"stopped broker pid {stopped.pid}" if stopped else "no broker running")
            return 0
        for orphan in clean_orphans():
            print(f"cleaned an orphaned broker left by a crashed run: pid {orphan.pid} ({orphan.data_dir})")
        found = running_broker(data_dir)
        if not found:
            others = [b for b in find_brokers() if b.data_dir != data_dir.resolve()]
            print(
                "no broker running"
                + (f" here ({len(others)} other embedded broker(s) on this machine, e.g. a test run)" if others else "")
            )
            return 1
        healthy = probe(found[1], 5.0)
        print(f"broker pid {found[0].pid} at {found[1]}: {'healthy' if healthy else 'NOT answering'}")
        return 0 if healthy else 1

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
