"""jobs/class_archive.py --ready: what ./replica setup says after spark-submit.sh has made (or not) the archive."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import class_archive


def test_ready_names_the_archive_spark_submit_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REPLICA_STATE_DIR", str(tmp_path))
    archive = tmp_path / "class-archive" / "spark-0123456789abcdef.jsa"
    archive.parent.mkdir()
    archive.write_bytes(b"\0" * (3 << 20))
    (archive.parent / "spark-0123456789abcdef.log").write_text("")
    assert class_archive.main(["--ready"]) == 0
    assert capsys.readouterr().out == f"class archive: {archive} (3 MB)\n"


def test_ready_without_an_archive_says_jobs_start_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REPLICA_STATE_DIR", str(tmp_path))  # REPLICA_CLASS_ARCHIVE=off, or a failed attempt
    assert class_archive.main(["--ready"]) == 0
    assert capsys.readouterr().out == "class archive: none (jobs start without one)\n"
