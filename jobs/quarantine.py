"""A replica's quarantine: ./spark-submit.sh jobs/quarantine.py {list|replay|drop} conf/orders_a.toml …

``list`` groups the unresolved records by reason (counts, tables, sample coordinates) and says how many keys they
hold; ``replay`` applies them again after a fix, exactly once and in log order (replica_lib.replay; the replica
stopped, or waited for with --wait); ``drop`` gives up records with a reason recorded (safe beside a running
replica): a key they held stays held while a later record of it waits in the quarantine, which ``replay`` applies.
Each is idempotent.
"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import amount, guarded, own_stdout, setup_logging
from replica_lib.config import load_replica, local_settings
from replica_lib.quarantine import DROPPED, reasons, resolve, select, unresolved
from replica_lib.replay import replay
from replica_lib.session import build_session
from replica_lib.target import ensure_replica_tables


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="quarantine", description="See, replay or drop a replica's quarantine.")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="unresolved records grouped by reason")
    again = commands.add_parser("replay", help="apply the unresolved records that decode now (after a fix)")
    drop = commands.add_parser("drop", help="give up records, with a reason, releasing the keys they hold")
    for sub in (listing, again, drop):
        sub.add_argument("conf", help="the replica's file in conf/")
        sub.add_argument("--table", action="append", default=[], help="only this table (repeatable)")
    again.add_argument("--note", default="", help="recorded with each record replayed")
    again.add_argument(
        "--wait", type=amount, default=0.0, metavar="S", help="wait up to S seconds for the running replica to stop"
    )
    drop.add_argument("--reason", required=True, help="why: recorded with each record dropped")
    drop.add_argument(
        "--at",
        action="append",
        default=[],
        metavar="TOPIC/PARTITION/OFFSET",
        help="only the record at this place (repeatable); without --at and --all nothing is dropped",
    )
    drop.add_argument("--all", action="store_true", help="every unresolved record (of --table, if given)")
    args = parser.parse_args(argv)
    if args.command == "drop" and not (args.at or args.all):
        parser.error("drop needs --at TOPIC/PARTITION/OFFSET or --all")
    for place in getattr(args, "at", []):
        parts = place.split("/")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            parser.error(f"--at {place}: write it as TOPIC/PARTITION/OFFSET, e.g. orders/0/41")
    out = own_stdout()
    setup_logging()

    def body() -> int:
        cfg = load_replica(args.conf)
        unknown = [t for t in args.table if t not in {table.name for table in cfg.tables}]
        if unknown:
            parser.error(f"--table {unknown[0]}: {cfg.source_file} has no such table")
        spark = build_session(f"replica-quarantine-{cfg.name}", local_settings())
        if args.command == "replay":
            print(replay(spark, cfg, args.table, args.note, args.wait).line(cfg.name), file=out)
            return 0
        ensure_replica_tables(spark, cfg)
        if args.command == "drop":
            records = unresolved(spark, cfg)
            chosen = None if records is None else select(records, args.table, args.at).localCheckpoint()
            n = 0 if chosen is None else chosen.count()
            if chosen is not None and n:
                resolve(spark, cfg, chosen, DROPPED, args.reason)
            print(f"replica {cfg.name}: dropped {n} quarantined records ({args.reason})", file=out)
            return 0
        found = [r for r in reasons(spark, cfg) if not args.table or set(r.tables) & set(args.table)]
        if not found:
            print(f"replica {cfg.name}: the quarantine holds no unresolved record", file=out)
            return 0
        print(f"{'RECORDS':>8}  {'TABLES':<16}  REASON (sample records: topic/partition/offset)", file=out)
        for r in found:
            print(f"{r.records:>8}  {','.join(r.tables):<16}  {r.reason}", file=out)
            print(f"{'':>8}  {'':<16}  e.g. {', '.join(r.samples)}", file=out)
        print(
            f"{sum(r.records for r in found)} unresolved records. After a fix: ./replica quarantine replay "
            f"{args.conf}; to give records up: ./replica quarantine drop {args.conf} --at T/P/O --reason '…'",
            file=out,
        )
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
