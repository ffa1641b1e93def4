"""SQL over replicas: ./replica sql [conf/orders_a.toml] "SELECT status, count(*) FROM orders_a.orders GROUP BY 1"

Every replica registered in the catalog is a database of its name (``orders_a.orders``, ``orders_a.quarantine``:
:mod:`replica_lib.catalog`). When the SQL server runs (``./replica serve``), queries go to it through beeline, with
no Spark session to start; a replica file given is registered there first and becomes the current database, so
``orders`` names its table. Without a server, or with ``--after``, ``--output`` or several replica files, the
command opens a session of its own: each table of the (freshest) replica is also a view named after it (``orders``),
plus ``<replica>_quarantine`` for its rejects, and
``replica_status`` (one row per replica, table and partition: applied and end offsets, lag, health) when a query
names it.
Given several replicas of one log, the views read the one that has applied the most (monotonic reads); with
``--after topic:partition:offset`` (a write's position, as the producer returns it), they read a replica that has
applied that write, waiting up to ``--timeout`` seconds for one (read-your-writes).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

from pyspark.sql import SparkSession

from jobs._cli import USER_ERROR, amount, guarded, setup_logging
from replica_lib.catalog import leave_pending, metastore_holder, register_catalog
from replica_lib.config import ReplicaConfig, load_replicas, local_settings
from replica_lib.errors import CatalogError
from replica_lib.producer import Position
from replica_lib.reads import Snapshot, freshest, parse_position, wait_for
from replica_lib.server import ServerInfo, beeline, running_server
from replica_lib.session import build_session, local_metastore, stop_session
from replica_lib.status import status_df, status_of
from replica_lib.views import register_views

#: The view of the replicas' status (one row per replica, table and partition: lag, versions, health).
STATUS_VIEW = "replica_status"
#: How long to wait for the SQL server to register a replica file given.
REGISTER_TIMEOUT_S = 60.0


def _through_server(server: ServerInfo, replica: ReplicaConfig | None, queries: list[str]) -> int:
    """Run the queries on the SQL server: its tables printed as beeline prints them, a failure as one line."""
    url = server.url
    if replica is not None:
        left = leave_pending(replica, local_settings())
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while left.exists():
            if time.monotonic() > deadline:
                raise CatalogError(f"the SQL server at {server.url} did not register {replica.name} in time")
            time.sleep(0.2)  # the server registers pending entries every second
        url = server.url_for(replica.name)  # its database is the session's: ``orders`` names its table
    result = beeline(url, ";\n".join(query.strip().rstrip(";") for query in queries))
    print(result.output, end="")
    if result.error is not None:
        print(f"error: {result.error}", file=sys.stderr)
        return USER_ERROR
    return 0


def _register_views(
    spark: SparkSession,
    replicas: Sequence[ReplicaConfig],
    positions: list[Position],
    queries: list[str],
    timeout: float,
) -> None:
    """Each table of the freshest replica (or of one that applied ``positions``) as a view of its name."""
    topics = {p.topic for p in positions}
    tables = [t.name for t in replicas[0].tables if t.topic in topics] or [replicas[0].tables[0].name]
    snapshots: list[Snapshot] = []
    for table in tables:
        if positions:
            mine = [p for p in positions if p.topic == replicas[0].table(table).topic]
            snapshots.append(wait_for(spark, replicas, table, mine, timeout))
        else:
            snapshots.append(freshest(spark, replicas, table))
    chosen = snapshots[0].replica
    pinned = {s.table.name: s.version for s in snapshots if s.replica is chosen and s.version is not None}
    register_views(spark, chosen, pinned)
    if any(STATUS_VIEW in query for query in queries):  # computed only when asked: it reads every table
        status_df(spark, [status_of(spark, cfg) for cfg in replicas]).createOrReplaceTempView(STATUS_VIEW)
    if len(replicas) > 1 or positions:
        print(f"reading replica {chosen.name} ({', '.join(f'{t} at version {v}' for t, v in pinned.items())})")


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
    parser.add_argument("--timeout", type=amount, default=30.0, help="seconds to wait for --after (default 30)")
    args = parser.parse_intermixed_args(argv)  # options may come between the files and the queries
    confs = [a for a in args.args if a.endswith(".toml")]
    queries = [a for a in args.args if not a.endswith(".toml")]
    if not queries or args.args[: len(confs)] != confs:
        parser.print_usage(sys.stderr)
        print("sql: error: give replica files (*.toml) if any, then one or more queries", file=sys.stderr)
        return USER_ERROR
    if not confs and (args.after or any(STATUS_VIEW in query for query in queries)):
        print("sql: error: --after and replica_status need the replica files (*.toml)", file=sys.stderr)
        return USER_ERROR
    try:
        positions = [parse_position(text) for text in args.after]
    except ValueError as exc:
        print(f"sql: error: --after: {exc}", file=sys.stderr)
        return USER_ERROR
    setup_logging()

    def body() -> int:
        replicas = load_replicas(confs)
        settings = local_settings()
        server = running_server(settings)
        local_only = positions or args.output or len(replicas) > 1 or any(STATUS_VIEW in q for q in queries)
        if server is not None and not local_only:
            return _through_server(server, replicas[0] if replicas else None, queries)
        # Without a server this process opens the catalog itself, unless another holds it (names are then missing).
        held = server is not None or metastore_holder(settings)
        if held:
            logging.getLogger(__name__).warning(
                "the local catalog is held by another process (the SQL server, a notebook): only the views of the "
                "replica files given are there"
            )
        name = replicas[0].name if replicas else "catalog"
        spark = build_session(f"replica-sql-{name}", settings, catalog=not held)
        if local_metastore(spark, settings):
            register_catalog(spark, replicas, settings)
        if replicas:
            _register_views(spark, replicas, positions, queries, args.timeout)
        for query in queries:
            print(f"\n{query}")
            result_df = spark.sql(query)
            result_df.show(args.limit, truncate=False)
        if args.output:
            with open(args.output, "w") as out:
                for row in result_df.toLocalIterator():
                    out.write(json.dumps(row.asDict(recursive=True), default=str) + "\n")
        if local_metastore(spark, settings):
            stop_session(spark)  # releases the local catalog before the command returns
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
