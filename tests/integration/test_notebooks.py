"""The notebooks run headless (nbclient, a real kernel) against the run's two small replicas, so they cannot rot.

Their cells assert what they show; what they found is also written to a folder and checked here against the
reference model. They use only the public API (``replica_lib.__all__``) and are stored without outputs.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

import replica_lib
from replica_dev.model import LoggedChange, fold
from replica_dev.polling import wait_for
from replica_lib.catalog import metastore_holder
from replica_lib.config import PROJECT_ROOT, local_settings
from tests.integration.conftest import TwoReplicas

pytestmark = pytest.mark.integration

NOTEBOOKS = ("replica_tour.ipynb", "replica_operations.ipynb")
CELL_TIMEOUT_S = 600


def _stored(name: str) -> Any:
    return nbformat.read(PROJECT_ROOT / "notebooks" / name, as_version=4)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_are_stored_clean_and_use_the_public_api(name: str) -> None:
    notebook = _stored(name)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [(cell.outputs, cell.execution_count) for cell in code] == [([], None)] * len(code)
    imported = set()
    for cell in code:
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("replica"):
                assert node.module == "replica_lib", f"{name} imports from {node.module}"
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.Import):
                assert not [a.name for a in node.names if a.name.startswith("replica")], f"{name}: {node.names}"
    assert imported and imported <= set(replica_lib.__all__), imported - set(replica_lib.__all__)


def test_the_notebooks_run_headless(two_replicas: TwoReplicas, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log, topic = two_replicas.log, two_replicas.topic
    middle = log[len(log) // 2].position  # the tour travels back to the first version that reflected it
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("REPLICA_CONFS", os.pathsep.join(str(c) for c in (two_replicas.a_conf, two_replicas.b_conf)))
    monkeypatch.setenv("REPLICA_POSITION", f"{middle.topic}:{middle.partition}:{middle.offset}")
    monkeypatch.setenv("REPLICA_NOTEBOOK_OUT", str(out))
    monkeypatch.setenv("REPLICA_CATALOG_DIR", str(tmp_path / "catalog"))
    for name in NOTEBOOKS:
        # The previous kernel's JVM outlives it a moment, with the local catalog open: the next waits for it.
        wait_for(lambda: not metastore_holder(local_settings()), 60, "the previous notebook's JVM to exit")
        client = NotebookClient(
            _stored(name),
            timeout=CELL_TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": str(tmp_path)}},
        )
        client.execute()  # raises CellExecutionError, with the cell and its trace, if a cell fails

    then = json.loads((out / "tour_then.json").read_text())
    reached = {int(p): o for p, o in then["offsets"][topic].items()}
    assert reached[middle.partition] > middle.offset
    before: list[LoggedChange] = [e for e in log if e.position.offset < reached.get(e.position.partition, 0)]
    rows = fold(before, {"orders": ("order_id",)}, {"orders": True})["orders"]
    columns = ["order_id", "customer", "amount", "status", "updated_ms"]
    assert then["rows"] == [{c: row[c] for c in columns} for _, row in sorted(rows.items())]

    quarantined = json.loads((out / "quarantine.json").read_text())
    assert [(q["replica"], q["records"]) for q in quarantined] == [("served_a", 1), ("served_b", 1)]
    assert (out / "replicas_over_time.png").stat().st_size > 0
