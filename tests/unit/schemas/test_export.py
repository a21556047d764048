"""The JSON Schemas and AsyncAPI document under docs/schemas/ are what the code says."""

from __future__ import annotations

from schemas.export import DEFAULT_OUT, documents, render


def test_committed_schemas_are_current() -> None:
    stale = [
        name
        for name, doc in documents().items()
        if not (DEFAULT_OUT / name).exists() or (DEFAULT_OUT / name).read_text() != render(doc)
    ]
    assert stale == [], f"run `python -m schemas.export`: stale {stale}"


def test_job_spec_schema_names_every_field_a_producer_needs() -> None:
    spec = documents()["job.submitted.json"]
    for field in (
        "tenant",
        "replicas",
        "resources",
        "topology",
        "priority_class",
        "idempotency_key",
        "labels",
        "preemptible",
        "checkpoint_grace_s",
    ):
        assert field in spec["properties"], field
    assert spec["required"] == ["tenant"]


def test_every_topic_is_in_the_catalogue() -> None:
    from schemas.topics import TOPICS

    catalogue = (DEFAULT_OUT.parent / "events.md").read_text()
    missing = [t.name for t in TOPICS if f"| `{t.name}` | {t.key}" not in catalogue]
    assert missing == []
