"""Catalog names for every replica: ``<replica>.<table>`` shows a table's state, other names its internals.

Each replica is a database named after ``[replica] name``, holding:

- ``<table>``: a view of the table's **state** with the user's columns only (a merge-on-read table's view ranks its
  pending changes, as :func:`replica_lib.layout.state_sql` does);
- ``<table>__raw``: the Delta table as the replica writes it, provenance columns (``_src_*``) included (an external
  table at the target's path, so ``VERSION AS OF`` works on it; for a merge-on-read table, its base);
- ``<table>__deletes``: its retained deletes; ``<table>__changes``: a merge-on-read table's change log;
- ``quarantine`` (records that could not be applied) and ``metrics`` (one row per batch, when configured).

Registering is idempotent: existing names are kept, a name whose location moved is created again (tables are
external: dropping a name never deletes data), views are replaced. Tables not created yet are left out until the
next registration.

**Who registers.** A replica registers itself when it starts: directly when its session has a persistent catalog of
the user's (a Hive metastore service, Glue, …). Otherwise the catalog is the local default, an embedded Derby
database that one JVM at a time may open, and the replica never opens it: it leaves its entries as a file in
``<catalog>/catalog-pending/`` for the process that holds the catalog: the SQL server (``./replica serve``) applies
them within a second, or else the next ``./replica sql``, ``./replica catalog register`` or notebook does. So a
running replica is never blocked by, and never blocks, a catalog that another process holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from py4j.protocol import Py4JError
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from replica_lib.config import LocalSettings, ReplicaConfig, Target, local_settings
from replica_lib.errors import CatalogError, ConfigError, ReplicaError
from replica_lib.layout import state_sql
from replica_lib.session import local_metastore, persistent_catalog
from replica_lib.target import changes_target, sql_string, table_schema, tombstone_target

logger = logging.getLogger(__name__)

#: Names of a replica's own tables in its database (a replica table may not take them).
QUARANTINE, METRICS = "quarantine", "metrics"
#: Suffixes of the names of a table's internals.
RAW, DELETES, CHANGES = "__raw", "__deletes", "__changes"
PENDING_DIR = "catalog-pending"


@dataclass(frozen=True)
class Entry:
    """One catalog name: an external Delta table at ``location``, or a view of ``query``."""

    database: str
    name: str
    comment: str
    location: str | None = None
    query: str | None = None
    needs: tuple[str, ...] = ()  # names this view reads: left out while one of them is
    source: str | None = None  # a catalog table this view reads (a ``{ table = "db.t" }`` target)

    @property
    def qualified(self) -> str:
        return f"{_quote(self.database)}.{_quote(self.name)}"


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _source(database: str, name: str, target: Target) -> Entry:
    """A Delta table of the replica under ``name``: external at its path, or a view of its catalog name."""
    if target.path:
        return Entry(database, name, f"replica {database}", location=target.path)
    return Entry(database, name, f"replica {database}", query=f"SELECT * FROM {target.table}", source=target.table)


def entries(cfg: ReplicaConfig) -> list[Entry]:
    """Every catalog name of a replica, tables before the views that read them; checked for clashes."""
    db = cfg.name
    found: list[Entry] = []
    for table in cfg.tables:
        schema = table_schema(table, cfg.source_file)
        raw = _source(db, table.name + RAW, table.target)
        deletes = _source(db, table.name + DELETES, tombstone_target(table))
        found += [raw, deletes]
        columns = ", ".join(_quote(f.name) for f in schema.kept.fields)
        raw_name = f"{_quote(db)}.{_quote(raw.name)}"
        needs: tuple[str, ...] = (raw.name,)
        if table.merge_on_read:
            changes = _source(db, table.name + CHANGES, changes_target(table))
            found.append(changes)
            base, log, retained = (f"{_quote(db)}.{_quote(e.name)}" for e in (raw, changes, deletes))
            rows = f"SELECT {columns} FROM ({state_sql(schema, base, log, retained)}) AS state"
            needs = (raw.name, changes.name, deletes.name)
        else:
            rows = f"SELECT {columns} FROM {raw_name}"
        found.append(Entry(db, table.name, f"replica {db}: the state of {table.name}", query=rows, needs=needs))
    found.append(_source(db, QUARANTINE, cfg.quarantine))
    if cfg.metrics is not None:
        found.append(_source(db, METRICS, cfg.metrics))
    seen: dict[str, str] = {}
    tables = {table.name.lower(): table.name for table in cfg.tables}
    for entry in found:
        if entry.name.lower() in seen:
            clash = tables.get(entry.name.lower()) or tables.get(seen[entry.name.lower()].lower(), entry.name)
            raise ConfigError(
                cfg.source_file,
                f"tables.{clash}",
                f"catalog name {db}.{entry.name} would be used twice (a table named like another's "
                f"{RAW}, {DELETES} or {CHANGES}, or like the replica's {QUARANTINE} or {METRICS})",
                "rename the table",
            )
        seen[entry.name.lower()] = entry.name
    return found


# ---------------------------------------------------------------------------------------------- applying
def _location(text: str) -> str:
    for prefix in ("file://", "file:"):
        if text.startswith(prefix):
            return os.path.normpath(text[len(prefix) :])
    return text.rstrip("/") if "://" in text else os.path.normpath(os.path.abspath(text))


def _existing(spark: SparkSession, entry: Entry) -> tuple[str, str | None] | None:
    """(table type, location) of the name as it stands, or None."""
    if not spark.catalog.tableExists(f"{entry.database}.{entry.name}"):
        return None
    table = spark.catalog.getTable(f"{entry.database}.{entry.name}")
    if table.tableType == "VIEW":
        return "VIEW", None
    rows = spark.sql(f"DESCRIBE TABLE EXTENDED {entry.qualified}").collect()
    location = next((row["data_type"] for row in rows if row["col_name"] == "Location"), None)
    return str(table.tableType), location


def _drop(spark: SparkSession, entry: Entry, kind: str) -> None:
    if kind == "VIEW":
        spark.sql(f"DROP VIEW {entry.qualified}")
    elif kind == "EXTERNAL":
        spark.sql(f"DROP TABLE {entry.qualified}")  # external: the data stays where it is
    else:
        raise CatalogError(
            f"{entry.database}.{entry.name} is a {kind.lower()} table, not one the replica registered; drop or "
            "rename it (DROP TABLE deletes a managed table's data), then register again"
        )


def _exists(spark: SparkSession, entry: Entry) -> bool | None:
    """Whether the table an entry names is there (None for a view of other entries)."""
    from delta.tables import DeltaTable

    if entry.location is not None:
        return bool(DeltaTable.isDeltaTable(spark, entry.location))
    if entry.source is not None:
        return bool(spark.catalog.tableExists(entry.source))
    return None


def _apply_entry(spark: SparkSession, entry: Entry) -> bool:
    """Make one name what ``entry`` says; False when its table does not exist yet."""
    if _exists(spark, entry) is False:
        return False
    existing = _existing(spark, entry)
    if entry.location is not None:
        if existing is not None and existing[1] is not None and _location(existing[1]) == _location(entry.location):
            return True
        if existing is not None:
            _drop(spark, entry, existing[0])
        spark.sql(
            f"CREATE TABLE {entry.qualified} USING delta LOCATION {sql_string(entry.location)} "
            f"COMMENT {sql_string(entry.comment)}"
        )
        return True
    assert entry.query is not None
    if existing is not None and existing[0] != "VIEW":
        _drop(spark, entry, existing[0])
    spark.sql(f"CREATE OR REPLACE VIEW {entry.qualified} COMMENT {sql_string(entry.comment)} AS {entry.query}")
    return True


def apply(spark: SparkSession, replica: str, source_file: str, wanted: Sequence[Entry]) -> list[str]:
    """Register ``wanted`` in the session's catalog; returns the names registered (those not yet created left out).

    A replica none of whose tables exists (not started yet, or its tables gone) gets no database.
    """
    if not any(_exists(spark, entry) for entry in wanted):
        logger.info("catalog: %s not registered: none of its tables exists", replica)
        return []
    if not spark.catalog.databaseExists(replica):  # Spark 4.2 warns of an existing one "created concurrently"
        comment = sql_string(f"replica {replica} ({source_file})")
        spark.sql(f"CREATE DATABASE IF NOT EXISTS {_quote(replica)} COMMENT {comment}")
    done: list[str] = []
    missing: set[str] = set()
    for entry in wanted:
        if any(name in missing for name in entry.needs) or not _apply_entry(spark, entry):
            missing.add(entry.name)
            continue
        done.append(f"{entry.database}.{entry.name}")
    if missing:
        logger.info("catalog: %s not registered (no table there yet): %s", replica, ", ".join(sorted(missing)))
    return done


def register_catalog(
    spark: SparkSession, replicas: Iterable[ReplicaConfig], settings: LocalSettings | None = None
) -> list[str]:
    """Register every replica's names in the session's catalog (and, in the local catalog, the entries replicas
    left pending); returns the names registered. Safe to repeat."""
    names: list[str] = []
    if local_metastore(spark, settings or local_settings()):
        names += apply_pending(spark, settings or local_settings())
    for cfg in replicas:
        names += apply(spark, cfg.name, cfg.source_file, entries(cfg))
    return names


# ---------------------------------------------------------------------------------------------- pending entries
def pending_dir(settings: LocalSettings) -> Path:
    return settings.catalog_home / PENDING_DIR


def leave_pending(cfg: ReplicaConfig, settings: LocalSettings) -> Path:
    """Leave a replica's entries for the process that holds the local catalog (written whole, then renamed)."""
    folder = pending_dir(settings)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.time_ns():020d}-{os.getpid()}-{cfg.name}.json"
    body = {"replica": cfg.name, "source_file": cfg.source_file, "entries": [asdict(e) for e in entries(cfg)]}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(body))
    partial.rename(path)
    return path


def pending(settings: LocalSettings) -> list[Path]:
    folder = pending_dir(settings)
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def apply_pending(spark: SparkSession, settings: LocalSettings) -> list[str]:
    """Register the entries replicas left, oldest first, and remove them; one that fails is logged and removed
    (its replica leaves it again at its next start, and ``./replica catalog register`` registers it at once)."""
    names: list[str] = []
    for path in pending(settings):
        try:
            body = json.loads(path.read_text())
            wanted = [Entry(**{**e, "needs": tuple(e["needs"])}) for e in body["entries"]]
            names += apply(spark, body["replica"], body["source_file"], wanted)
        except (OSError, ValueError, KeyError, TypeError, PySparkException, Py4JError, ReplicaError) as exc:
            logger.warning("catalog: could not register %s: %s", path.name, str(exc).strip().splitlines()[0][:300])
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return names


def register_on_start(spark: SparkSession, cfg: ReplicaConfig, settings: LocalSettings | None = None) -> None:
    """A starting replica's registration: directly in a persistent catalog of the user's, else left pending.

    Never fails the replica: its names are a convenience for readers, not part of what it applies, so any failure
    (the metastore down, a name taken) is a warning, and the next start or ``./replica catalog register`` retries.
    """
    local = settings or local_settings()
    try:
        if persistent_catalog(spark) and not local_metastore(spark, local):
            names = register_catalog(spark, [cfg], local)
            logger.info("replica %s: registered %d catalog names (%s.*)", cfg.name, len(names), cfg.name)
        else:
            path = leave_pending(cfg, local)
            logger.info("replica %s: catalog names left for the catalog's holder in %s", cfg.name, path.parent)
    except (OSError, PySparkException, Py4JError, ReplicaError) as exc:
        logger.warning("replica %s: catalog names not registered: %s", cfg.name, str(exc).strip().splitlines()[0])


# ---------------------------------------------------------------------------------------------- the local catalog
def metastore_holder(settings: LocalSettings) -> bool:
    """Whether a JVM has the local Derby metastore open now (Derby holds a file lock on ``dbex.lck`` meanwhile)."""
    lock = settings.catalog_home / "metastore" / "dbex.lck"
    try:
        handle = lock.open("rb+")
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.lockf(handle, fcntl.LOCK_UN)
        return False
