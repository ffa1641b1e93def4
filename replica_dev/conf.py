"""Replica files for tests and the harness: one document shape, written as TOML the way users write them.

A document is what ``tomllib`` returns for a replica file (``replica_lib.config.parse_replica`` takes it);
:func:`replica_doc` builds one whose checkpoint, quarantine and tables live under one folder, and
:func:`write_replica` writes it as a file for jobs that read one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The demo primary's orders table (``replica_dev.loadgen`` writes rows of it).
ORDERS_SCHEMA = "order_id BIGINT, customer STRING, amount DOUBLE, status STRING, updated_ms BIGINT"


def orders_table(topic: str, **overrides: Any) -> dict[str, Any]:
    """The orders table fed by ``topic``, keyed by ``order_id`` and ordered by ``seq``."""
    return {"topic": topic, "keys": ["order_id"], "sequence_by": "seq", "schema": ORDERS_SCHEMA, **overrides}


def replica_doc(
    name: str, root: Path | str, bootstrap: str, tables: Mapping[str, Mapping[str, Any]], **sections: Any
) -> dict[str, Any]:
    """A replica ``name`` whose checkpoint, quarantine and tables (without a target of their own) are under ``root``.

    ``sections`` add to or override sections: ``trigger={"available_now": True}``, ``kafka={...}``, or
    ``replica={...}`` (merged into the ``[replica]`` section).
    """
    base = Path(root)
    doc: dict[str, Any] = {
        "replica": {
            "name": name,
            "checkpoint": str(base / "_checkpoint"),
            "quarantine": {"path": str(base / "_quarantine")},
            **sections.pop("replica", {}),
        },
        "kafka": {"bootstrap_servers": bootstrap},
        "tables": {table: {"target": {"path": str(base / table)}, **spec} for table, spec in tables.items()},
    }
    doc.update(sections)
    return doc


def to_toml(doc: Mapping[str, Any]) -> str:
    """``doc`` as a TOML file: a section per top-level key (``[tables.<name>]`` for each table)."""
    lines: list[str] = []
    for section, body in doc.items():
        if section == "tables":
            for table, spec in body.items():
                lines += ["", f"[tables.{table}]", *(f"{k} = {_value(v)}" for k, v in spec.items())]
        else:
            lines += ["", f"[{section}]", *(f"{k} = {_value(v)}" for k, v in body.items())]
    return "\n".join(lines).lstrip() + "\n"


def write_replica(path: Path, doc: Mapping[str, Any]) -> Path:
    """Write ``doc`` to ``path`` as TOML; returns ``path``."""
    path.write_text(to_toml(doc))
    return path


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {type(value).__name__}")
