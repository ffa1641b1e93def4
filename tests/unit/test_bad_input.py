"""Bad input ends quickly, in one line that names the cause and the fix."""

from __future__ import annotations

import importlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from jobs import materialize
from replica_dev.embedded_kafka import free_port
from replica_lib.config import PROJECT_ROOT, parse_replica
from replica_lib.errors import ConfigError
from replica_lib.source import check_reachable


def _cfg(bootstrap: str) -> object:
    doc = {
        "replica": {"name": "r", "checkpoint": "/tmp/c", "quarantine": {"path": "/tmp/q"}},
        "kafka": {"bootstrap_servers": bootstrap},
        "tables": {"t": {"topic": "t", "keys": ["id"], "schema": "id BIGINT", "target": {"path": "/tmp/t"}}},
    }
    return parse_replica(doc, "r.toml", {})


def test_unreachable_broker_fails_within_the_timeout_naming_the_setting() -> None:
    cfg = _cfg(f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        check_reachable(cfg, timeout_s=1.0)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    assert caught.value.key == "kafka.bootstrap_servers"
    assert "no Kafka broker reachable within 1s" in str(caught.value)


def test_malformed_bootstrap_servers_fail_at_once() -> None:
    with pytest.raises(ConfigError) as caught:  # when the file is read: before a checkpoint folder is made
        _cfg("localhost")
    assert "'localhost' is not host:port" in str(caught.value)


def test_materialize_job_with_a_bad_conf_prints_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text((PROJECT_ROOT / "conf" / "orders_a.toml").read_text().replace("[trigger]", "[trigger]\nspeed = 1"))
    assert materialize.main([str(conf)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"error: {conf}: trigger.speed: unknown key")


def test_scripts_stop_at_once_without_a_usable_java(tmp_path: Path) -> None:
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-such-jdk")}
    started = time.monotonic()
    proc = subprocess.run(
        [str(PROJECT_ROOT / "replica"), "setup"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert time.monotonic() - started < 10
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "replica: no Java found: install Java 17+ (apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
    ]


@pytest.mark.parametrize(
    ("job", "args", "option"),
    [
        ("maintain", ["conf/orders_a.toml", "--retain-hours", "nan"], "--retain-hours"),  # a VACUUM of 0 h, unchecked
        ("rebuild", ["conf/orders_a.toml", "--into", "/tmp/r", "--swap", "--wait", "nan"], "--wait"),
        ("quarantine", ["replay", "conf/orders_a.toml", "--wait", "inf"], "--wait"),
        ("sql", ["conf/orders_a.toml", "SELECT 1", "--timeout", "nan"], "--timeout"),
        ("status", ["conf/orders_a.toml", "--max-lag-seconds", "-1"], "--max-lag-seconds"),
        ("topics", ["create", "t", "--delete-retention-days", "nan"], "--delete-retention-days"),
    ],
)
def test_a_number_argument_that_is_not_finite_or_is_negative_stops_the_job_before_it_starts(
    job: str, args: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(f"jobs.{job}").main
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert f"error: argument {option}: must be a finite number, 0 or more, not '{args[-1]}'" in line
