"""replica_lib.artifacts: the jars a local start takes instead of resolving its packages again."""

from __future__ import annotations

from pathlib import Path

import pytest

from replica_lib import artifacts
from replica_lib.artifacts import SPARK_PACKAGES, record_resolved, resolved_jars
from replica_lib.config import LocalSettings
from replica_lib.session import session_conf

PACKAGES = ",".join(SPARK_PACKAGES)


def _cache(ivy: Path, *names: str) -> list[Path]:
    (ivy / "jars").mkdir(parents=True, exist_ok=True)
    jars = [ivy / "jars" / name for name in names]
    for jar in jars:
        jar.write_bytes(b"PK")
    return jars


def test_a_recorded_resolution_gives_the_cached_jars_in_order_without_the_users_own(tmp_path: Path) -> None:
    ivy = tmp_path / "ivy"
    delta, kafka = _cache(ivy, "io.delta_delta-spark.jar", "org.apache.kafka_kafka-clients.jar")
    mine = tmp_path / "mine.jar"
    mine.write_bytes(b"PK")
    assert resolved_jars(SPARK_PACKAGES, ivy) == ()
    record_resolved(PACKAGES, f"file://{delta},file://{mine},file://{kafka}", ivy)
    assert resolved_jars(SPARK_PACKAGES, ivy) == (str(delta), str(kafka))
    assert resolved_jars(tuple(reversed(SPARK_PACKAGES)), ivy) == (str(delta), str(kafka))  # one set, any order
    assert resolved_jars((*SPARK_PACKAGES, "org.apache.spark:spark-avro_2.13:4.1.1"), ivy) == ()


def test_a_jar_gone_from_the_cache_or_other_ivy_settings_resolve_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ivy = tmp_path / "ivy"
    delta, kafka = _cache(ivy, "delta.jar", "kafka.jar")
    record_resolved(PACKAGES, f"file://{delta},file://{kafka}", ivy)
    kafka.unlink()
    assert resolved_jars(SPARK_PACKAGES, ivy) == ()
    record_resolved(PACKAGES, f"file://{delta}", ivy)  # what the next start resolved replaces the record
    assert resolved_jars(SPARK_PACKAGES, ivy) == (str(delta),)

    settings = tmp_path / "ivysettings.xml"
    settings.write_text(artifacts.IVY_SETTINGS.read_text().replace("central", "central-mirror"))
    monkeypatch.setattr(artifacts, "IVY_SETTINGS", settings)
    assert resolved_jars(SPARK_PACKAGES, ivy) == ()


def test_nothing_is_recorded_without_packages_or_cached_jars(tmp_path: Path) -> None:
    ivy = tmp_path / "ivy"
    (jar,) = _cache(ivy, "delta.jar")
    record_resolved("", f"file://{jar}", ivy)
    record_resolved(PACKAGES, f"file://{tmp_path / 'elsewhere.jar'}", ivy)
    assert not (ivy / "resolved").exists()


def test_a_local_session_takes_the_recorded_jars_and_a_submitted_one_names_the_packages(tmp_path: Path) -> None:
    settings = LocalSettings(state_dir=tmp_path, java_home=None)
    assert session_conf(settings, "local[2]", ui=False)["spark.jars.packages"] == PACKAGES
    delta, kafka = _cache(tmp_path / "ivy", "delta.jar", "kafka.jar")
    record_resolved(PACKAGES, f"file://{delta},file://{kafka}", tmp_path / "ivy")
    local = session_conf(settings, "local[2]", ui=False)
    assert local["spark.jars"] == f"{delta},{kafka}" and "spark.jars.packages" not in local
    # Under spark-submit.sh (no master given) the launch chose: the session names the packages, as before.
    assert session_conf(settings, None, ui=False)["spark.jars.packages"] == PACKAGES
