"""The product package stands alone: what ships never imports the dev harness, and its public names resolve."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import replica_lib

PRODUCT = Path(replica_lib.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_replica_lib_never_imports_the_dev_package_or_the_jobs() -> None:
    offenders = {
        f"{path.relative_to(PRODUCT.parent)} imports {module}"
        for path in PRODUCT.rglob("*.py")
        for module in _imported_modules(path)
        if module.split(".")[0] in {"replica_dev", "jobs", "tests", "matplotlib", "kafka2delta"}
    }
    assert not offenders, sorted(offenders)


def test_every_public_name_resolves() -> None:
    for name in replica_lib.__all__:
        assert getattr(replica_lib, name) is not None, name


def test_a_primary_service_imports_the_producer_without_spark() -> None:
    code = "import sys; from replica_lib import ChangeProducer, Change; print('pyspark' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
