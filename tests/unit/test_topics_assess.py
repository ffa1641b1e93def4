"""topics.assess(): which topic settings make a replication log unsafe, judged without a broker."""

from __future__ import annotations

import pytest

from replica_lib.topics import DAY_MS, Finding, TopicReport, TopicSpec, assess

SAFE: dict[str, str] = {
    "cleanup.policy": "compact",
    "min.insync.replicas": "2",
    "delete.retention.ms": str(7 * DAY_MS),
    "unclean.leader.election.enable": "false",
}


def _settings(findings: tuple[Finding, ...], level: str) -> list[str]:
    return [f.setting for f in findings if f.level == level]


def test_safe_compacted_topic_has_no_findings() -> None:
    assert assess(6, 3, SAFE, None, local=False) == ()


def test_safe_topic_matching_its_spec_has_no_findings() -> None:
    spec = TopicSpec("orders", partitions=6)

    assert assess(6, 3, spec.configs(), spec, local=False) == ()


def test_replication_factor_one_is_unsafe_off_the_sandbox() -> None:
    findings = assess(6, 1, {**SAFE, "min.insync.replicas": "1"}, None, local=False)

    assert findings == (findings[0],)
    assert findings[0].level == "unsafe"
    assert findings[0].setting == "replication.factor"
    assert "use 3" in findings[0].message


def test_replication_factor_one_is_only_a_note_in_the_sandbox() -> None:
    findings = assess(3, 1, {**SAFE, "min.insync.replicas": "1"}, None, local=True)

    assert [(f.level, f.setting) for f in findings] == [("note", "replication.factor")]
    report = TopicReport("orders", True, 3, 1, SAFE, findings)
    assert not report.unsafe


def test_min_insync_replicas_one_with_three_replicas_is_unsafe() -> None:
    findings = assess(6, 3, {**SAFE, "min.insync.replicas": "1"}, None, local=False)

    assert [(f.level, f.setting) for f in findings] == [("unsafe", "min.insync.replicas")]
    assert "set it to 2" in findings[0].message


def test_min_insync_replicas_defaults_to_one_when_unset() -> None:
    configs = {k: v for k, v in SAFE.items() if k != "min.insync.replicas"}

    assert _settings(assess(6, 3, configs, None, local=False), "unsafe") == ["min.insync.replicas"]


def test_delete_policy_with_finite_retention_is_unsafe_for_rebuilds() -> None:
    configs = {**SAFE, "cleanup.policy": "delete", "retention.ms": "3600000"}

    findings = assess(6, 3, configs, None, local=False)

    assert [(f.level, f.setting) for f in findings] == [("unsafe", "cleanup.policy")]
    assert "retention.ms=3600000" in findings[0].message
    assert "rebuilt" in findings[0].message


def test_delete_policy_defaults_to_finite_retention_when_unset() -> None:
    configs = {k: v for k, v in SAFE.items() if k != "cleanup.policy"}

    assert _settings(assess(6, 3, configs, None, local=False), "unsafe") == ["cleanup.policy"]


def test_delete_policy_with_infinite_retention_is_accepted() -> None:
    configs = {**SAFE, "cleanup.policy": "delete", "retention.ms": "-1"}

    assert assess(6, 3, configs, None, local=False) == ()


@pytest.mark.parametrize("policy", ["compact,delete", "delete, compact"])
def test_compact_and_delete_is_unsafe(policy: str) -> None:
    configs = {**SAFE, "cleanup.policy": policy, "retention.ms": str(DAY_MS)}

    findings = assess(6, 3, configs, None, local=False)

    assert [(f.level, f.setting) for f in findings] == [("unsafe", "cleanup.policy")]
    assert "compact alone" in findings[0].message
    assert "rebuild" in findings[0].message


def test_short_tombstone_retention_is_unsafe() -> None:
    configs = {**SAFE, "delete.retention.ms": str(DAY_MS - 1)}

    findings = assess(6, 3, configs, None, local=False)

    assert [(f.level, f.setting) for f in findings] == [("unsafe", "delete.retention.ms")]
    assert "tombstones" in findings[0].message


def test_exactly_one_day_of_tombstone_retention_is_accepted() -> None:
    assert assess(6, 3, {**SAFE, "delete.retention.ms": str(DAY_MS)}, None, local=False) == ()


def test_unclean_leader_election_is_unsafe() -> None:
    findings = assess(6, 3, {**SAFE, "unclean.leader.election.enable": "true"}, None, local=False)

    assert [(f.level, f.setting) for f in findings] == [("unsafe", "unclean.leader.election.enable")]


def test_partition_count_different_from_the_spec_is_a_mismatch() -> None:
    spec = TopicSpec("orders", partitions=6)

    findings = assess(12, 3, spec.configs(), spec, local=False)

    assert [(f.level, f.setting) for f in findings] == [("mismatch", "partitions")]
    assert findings[0].message.startswith("12, expected 6")
    assert TopicReport("orders", False, 12, 3, spec.configs(), findings).unsafe


def test_config_different_from_the_spec_is_a_mismatch() -> None:
    spec = TopicSpec("orders", delete_retention_ms=14 * DAY_MS)

    findings = assess(6, 3, SAFE, spec, local=False)

    assert [(f.level, f.setting) for f in findings] == [("mismatch", "delete.retention.ms")]


def test_several_problems_are_all_reported() -> None:
    configs = {
        "cleanup.policy": "delete",
        "retention.ms": str(DAY_MS),
        "min.insync.replicas": "1",
        "unclean.leader.election.enable": "true",
    }

    findings = assess(6, 3, configs, None, local=False)

    assert _settings(findings, "unsafe") == [
        "min.insync.replicas",
        "cleanup.policy",
        "unclean.leader.election.enable",
    ]
    assert str(findings[0]).startswith("[unsafe] min.insync.replicas: 1")


# ---------------------------------------------------------------------------------------------- TopicSpec
def test_spec_configs_for_a_compacted_topic() -> None:
    assert TopicSpec("orders").configs() == {
        "cleanup.policy": "compact",
        "min.insync.replicas": "2",
        "delete.retention.ms": str(7 * DAY_MS),
        "unclean.leader.election.enable": "false",
    }


def test_spec_for_a_delete_policy_topic_keeps_everything_unless_told() -> None:
    assert TopicSpec("orders", compact=False).configs()["retention.ms"] == "-1"
    spec = TopicSpec("orders", compact=False, extra=(("retention.ms", "3600000"),))
    assert spec.configs()["retention.ms"] == "3600000"


def test_local_spec_has_one_replica() -> None:
    spec = TopicSpec.local("orders")

    assert (spec.partitions, spec.replication_factor, spec.min_insync_replicas) == (3, 1, 1)


def test_min_insync_replicas_above_replication_factor_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_insync_replicas cannot exceed replication_factor"):
        TopicSpec("orders", replication_factor=2, min_insync_replicas=3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": ""},
        {"name": "t", "partitions": 0},
        {"name": "t", "replication_factor": 0},
        {"name": "t", "min_insync_replicas": 0},
    ],
)
def test_invalid_specs_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TopicSpec(**kwargs)  # type: ignore[arg-type]
