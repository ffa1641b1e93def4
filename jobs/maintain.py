"""Replica maintenance: ./spark-submit.sh jobs/maintain.py conf/orders_a.toml

Folds the pending changes of merge-on-read tables into them (replica_lib.layout), drops retained deletes that no
longer count or can no longer let a deleted key come back, then packs every table's small files (OPTIMIZE) and
deletes the files no version inside the time-travel window references (VACUUM; replica_lib.maintenance). Safe beside
a running replica; schedulable (each step is idempotent). Every VACUUM retention is checked before anything runs.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jobs._cli import amount, guarded, setup_logging
from replica_lib.config import load_replica, local_settings
from replica_lib.layout import fold
from replica_lib.maintenance import maintain, tidy_files, vacuum_plan
from replica_lib.recovery import log_order_kept
from replica_lib.session import build_session
from replica_lib.target import ensure_replica_tables
from replica_lib.topics import TopicAdmin


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="maintain", description="Fold a replica's pending changes; compact and purge its retained deletes."
    )
    parser.add_argument("conf", help="the replica's file in conf/")
    parser.add_argument(
        "--retain-hours",
        type=amount,
        help="VACUUM keeps files for this long (default: each table's time-travel window, "
        "delta.deletedFileRetentionDuration, a week unless set); a shorter one is refused with the reason",
    )
    parser.add_argument("--no-optimize", action="store_true", help="do not pack small files")
    parser.add_argument(
        "--zorder",
        action="store_true",
        help="rewrite each replica table's files ordered by its keys (OPTIMIZE ZORDER BY; every file, each run), "
        "so lookups and MERGEs by key read few files",
    )
    parser.add_argument("--no-vacuum", action="store_true", help="do not delete unreferenced files")
    args = parser.parse_args(argv)
    setup_logging()

    def body() -> int:
        cfg = load_replica(args.conf)
        spark = build_session(f"replica-maintain-{cfg.name}", local_settings())
        vacuum = None if args.no_vacuum else vacuum_plan(spark, cfg, args.retain_hours)  # refused before any write
        client = cfg.kafka.client_config()
        if client.settings is None:
            logging.getLogger("jobs.maintain").warning(
                "replica %s: expired retained deletes are kept, since the log's start offsets cannot be read here: %s",
                cfg.name,
                client.reason,
            )
        for schema in ensure_replica_tables(spark, cfg).values():
            if schema.table.merge_on_read:
                with log_order_kept(cfg):
                    folded = fold(spark, cfg.name, schema)
                print(f"{cfg.name}.{folded.line(schema.table.name)}")
        tidied = maintain(spark, cfg, None if client.settings is None else TopicAdmin(client.settings))
        for table, done in tidied.items():
            print(
                f"{cfg.name}.{table}: dropped {done.superseded} superseded and {done.purged} expired retained deletes"
            )
        if not (args.no_optimize and args.no_vacuum and not args.zorder):
            for files in tidy_files(spark, cfg, not args.no_optimize, vacuum, args.zorder):
                print(f"{cfg.name}: {files.line()}")
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
