"""Create or validate replica topics: ./replica topics create orders --partitions 6 [--local]"""

from __future__ import annotations

import argparse
import os
import sys

from jobs._cli import amount, guarded, setup_logging
from replica_lib.errors import ReplicationFactorError
from replica_lib.topics import DAY_MS, TopicAdmin, TopicReport, TopicSpec


def _print(report: TopicReport) -> None:
    state = "created" if report.created else "exists"
    print(
        f"topic {report.name}: {state}, {report.partitions} partitions, replication factor "
        f"{report.replication_factor}, cleanup.policy={report.configs.get('cleanup.policy')}"
    )
    for finding in report.findings:
        print(f"  {finding}")
    if not report.findings:
        print("  safe as a replication log")


def _too_few_brokers(name: str, exc: ReplicationFactorError, servers: str) -> str:
    """What to do when a topic asks for more copies than the cluster has brokers, in this command's terms."""
    rf = exc.replication_factor
    problem = f"topic {name}: replication factor {rf} needs {rf} brokers, {servers} has {exc.brokers}"
    if exc.brokers == 1:
        return f"{problem}: on the single-broker sandbox add --local"
    return f"{problem}: add brokers, or lower --replication-factor (and --min-insync-replicas)"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="topics", description="Create or validate replica topics.")
    parser.add_argument("action", choices=("create", "validate"))
    parser.add_argument("names", nargs="+")
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("REPLICA_BOOTSTRAP_SERVERS"),
        help="default: $REPLICA_BOOTSTRAP_SERVERS",
    )
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--replication-factor", type=int, default=3)
    parser.add_argument("--min-insync-replicas", type=int, default=2)
    parser.add_argument("--delete-retention-days", type=amount, default=7.0)
    parser.add_argument(
        "--local", action="store_true", help="single-broker sandbox: replication factor 1 is expected, not unsafe"
    )
    args = parser.parse_args(argv)
    setup_logging()
    if not args.bootstrap_servers:
        parser.error("--bootstrap-servers is required (or export REPLICA_BOOTSTRAP_SERVERS)")

    retention_ms = int(args.delete_retention_days * DAY_MS)
    specs = []
    for name in args.names:  # bad arguments (e.g. min.insync.replicas > replication factor) are usage errors
        try:
            specs.append(
                TopicSpec.local(name, partitions=args.partitions, delete_retention_ms=retention_ms)
                if args.local
                else TopicSpec(
                    name,
                    args.partitions,
                    args.replication_factor,
                    args.min_insync_replicas,
                    delete_retention_ms=retention_ms,
                )
            )
        except ValueError as exc:
            parser.error(f"{name}: {exc}")

    def body() -> int:
        admin = TopicAdmin({"bootstrap.servers": args.bootstrap_servers})
        unsafe = False
        for spec in specs:
            try:
                report = (
                    admin.ensure(spec, local=args.local)
                    if args.action == "create"
                    else admin.validate(spec.name, None, local=args.local)
                )
            except ReplicationFactorError as exc:
                if args.local:
                    raise
                print(f"error: {_too_few_brokers(spec.name, exc, args.bootstrap_servers)}", file=sys.stderr)
                return 2
            _print(report)
            unsafe |= report.unsafe
        return 1 if unsafe else 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
