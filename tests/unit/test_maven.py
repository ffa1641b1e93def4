"""Finding Java: version parsing and JAVA_HOME handling, without starting a broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from replica_dev import maven
from replica_lib.errors import SetupError


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('java version "1.8.0_292"\nJava(TM) SE Runtime Environment (build 1.8.0_292-b10)', 8),
        ('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime Environment (build 17.0.15+6)', 17),
        ('openjdk version "21" 2023-09-19\nOpenJDK Runtime Environment (build 21+35-2513)', 21),
        ('openjdk version "11.0.2" 2019-01-15', 11),
    ],
)
def test_parse_java_major(output: str, major: int) -> None:
    assert maven.parse_java_major(output) == major


def test_parse_java_major_of_unrelated_output_is_none() -> None:
    assert maven.parse_java_major("bash: java: command not found") is None


def test_find_java_with_a_missing_java_home_raises_setup_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-jdk"

    with pytest.raises(SetupError, match="no-such-jdk"):
        maven.find_java(str(missing))
