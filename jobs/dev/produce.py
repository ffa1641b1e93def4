"""The demo primary: ./replica produce orders --keys 200 --events 2000 [--rate 500]"""

from __future__ import annotations

import argparse
import os
import sys

from jobs._cli import guarded, setup_logging
from replica_dev import loadgen
from replica_lib.producer import ChangeProducer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="produce", description="Write a seeded mix of order changes to Kafka.")
    parser.add_argument("topic")
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("REPLICA_BOOTSTRAP_SERVERS"),
        help="default: $REPLICA_BOOTSTRAP_SERVERS",
    )
    parser.add_argument("--keys", type=int, default=200, help="distinct orders (default 200)")
    parser.add_argument("--events", type=int, default=2000, help="changes to write (default 2000)")
    parser.add_argument("--updates", type=float, default=0.6, help="share of updates (default 0.6)")
    parser.add_argument("--deletes", type=float, default=0.1, help="share of deletes (default 0.1)")
    parser.add_argument("--rate", type=float, help="events per second (default: as fast as possible)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    setup_logging()
    if not args.bootstrap_servers:
        parser.error("--bootstrap-servers is required (or export REPLICA_BOOTSTRAP_SERVERS)")
    try:
        workload = loadgen.Workload(
            keys=args.keys,
            events=args.events,
            update_share=args.updates,
            delete_share=args.deletes,
            rate=args.rate,
            seed=args.seed,
        )
    except ValueError as exc:
        parser.error(str(exc))

    def body() -> int:
        with ChangeProducer({"bootstrap.servers": args.bootstrap_servers}) as producer:
            logged = loadgen.run(producer, args.topic, workload)
        if logged:
            print(f"wrote {len(logged)} changes; last position {logged[-1].position}")
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
