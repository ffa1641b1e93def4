"""SQL over a replica's tables: ./replica sql conf/orders_a.toml "SELECT status, count(*) FROM orders GROUP BY 1"

Each table of the replica is a view named after it (``orders``), plus ``<replica>_quarantine`` for its rejects, and
``replica_status`` (one row per replica, table and partition: applied and end offsets, lag, health) when a query
names it.
Given several replicas of one log, the views read the one that has applied the most (monotonic reads); with
``--after topic:partition:offset`` (a write's position, as the producer returns it), they read a replica that has
applied that write, waiting up to ``--timeout`` seconds for one (read-your-writes).
"""

from __future__ import annotations

import argparse
import json
import sys

from jobs._cli import USER_ERROR, guarded, setup_logging
from replica_lib.config import load_replicas, local_settings
from replica_lib.reads import Snapshot, freshest, parse_position, wait_for
from replica_lib.session import build_session
from replica_lib.status import status_df, status_of
from replica_lib.views import register_views

#: The view of the replicas' status (one row per replica, table and partition: lag, versions, health).
STATUS_VIEW = "replica_status"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sql", description="Run SQL over a replica's Delta tables.")
    parser.add_argument("args", nargs="+", metavar="conf.toml | query", help="replica files, then SQL queries")
    parser.add_argument("--output", help="also write the last query's rows to this file as JSON lines")
    parser.add_argument("--limit", type=int, default=50, help="rows to print per query (default 50)")
    parser.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="TOPIC:PARTITION:OFFSET",
        help="read only once a replica has applied this write (repeatable)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for --after (default 30)")
    args = parser.parse_intermixed_args(argv)  # options may come between the files and the queries
    confs = [a for a in args.args if a.endswith(".toml")]
    queries = [a for a in args.args if not a.endswith(".toml")]
    if not confs or not queries or args.args[: len(confs)] != confs:
        parser.print_usage(sys.stderr)
        print("sql: error: give one or more replica files (*.toml), then one or more queries", file=sys.stderr)
        return USER_ERROR
    try:
        positions = [parse_position(text) for text in args.after]
    except ValueError as exc:
        print(f"sql: error: --after: {exc}", file=sys.stderr)
        return USER_ERROR
    setup_logging()

    def body() -> int:
        replicas = load_replicas(confs)
        spark = build_session(f"replica-sql-{replicas[0].name}", local_settings())
        topics = {p.topic for p in positions}
        tables = [t.name for t in replicas[0].tables if t.topic in topics] or [replicas[0].tables[0].name]
        snapshots: list[Snapshot] = []
        for table in tables:
            if positions:
                mine = [p for p in positions if p.topic == replicas[0].table(table).topic]
                snapshots.append(wait_for(spark, replicas, table, mine, args.timeout))
            else:
                snapshots.append(freshest(spark, replicas, table))
        chosen = snapshots[0].replica
        pinned = {s.table.name: s.version for s in snapshots if s.replica is chosen and s.version is not None}
        register_views(spark, chosen, pinned)
        if any(STATUS_VIEW in query for query in queries):  # computed only when asked: it reads every table
            status_df(spark, [status_of(spark, cfg) for cfg in replicas]).createOrReplaceTempView(STATUS_VIEW)
        if len(replicas) > 1 or positions:
            print(f"reading replica {chosen.name} ({', '.join(f'{t} at version {v}' for t, v in pinned.items())})")
        for query in queries:
            print(f"\n{query}")
            result_df = spark.sql(query)
            result_df.show(args.limit, truncate=False)
        if args.output:
            with open(args.output, "w") as out:
                for row in result_df.toLocalIterator():
                    out.write(json.dumps(row.asDict(recursive=True), default=str) + "\n")
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
