"""Writes the wire contract for other platforms: a JSON Schema per topic payload, the envelope's,
and an AsyncAPI document, under docs/schemas/. Run `python -m schemas.export`; a unit test
fails when the committed files are stale."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from schemas.envelope import Envelope
from schemas.events import LeaderFence
from schemas.topics import FENCED_TOPICS, LEADER_FENCE, TOPICS, Topic

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "schemas"


def _schema_of(topic: Topic) -> dict[str, Any] | None:
    if topic.payload is None:
        return None
    schema = topic.payload.model_json_schema(mode="validation")
    schema["$id"] = f"{topic.name}.json"
    schema["description"] = (
        f"Payload of `{topic.event_type}` on topic `{topic.name}` (partition key: "
        f"{topic.key}). {topic.description}"
    )
    return schema


def documents() -> dict[str, dict[str, Any]]:
    """File name -> JSON document."""
    docs: dict[str, dict[str, Any]] = {}
    envelope = Envelope.model_json_schema(mode="validation")
    envelope["$id"] = "envelope.json"
    docs["envelope.json"] = envelope
    channels: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    fence = LeaderFence.model_json_schema(mode="validation")
    fence["$id"] = "leader-fence.json"
    fence["description"] = (
        f"Payload of `{LEADER_FENCE}` on {', '.join(FENCED_TOPICS)} (every partition). "
        + fence.get("description", "")
    )
    docs["leader-fence.json"] = fence
    messages[LEADER_FENCE] = {
        "name": LEADER_FENCE,
        "summary": "A new scheduler leader's epoch, on every partition, before its first decision.",
        "contentType": "application/json",
        "payload": {"$ref": "leader-fence.json"},
    }
    for topic in TOPICS:
        schema = _schema_of(topic)
        if schema is not None:
            docs[f"{topic.name}.json"] = schema
        messages[topic.event_type] = {
            "name": topic.event_type,
            "summary": topic.description,
            "contentType": "application/json",
            "payload": {"$ref": f"{topic.name}.json"} if schema else {"type": "object"},
        }
        channels[topic.name] = {
            "address": topic.name,
            "description": f"{topic.description} Partition key: {topic.key}; "
            f"{topic.partitions} partitions by default.",
            "messages": {
                t: {"$ref": f"#/components/messages/{t}"}
                for t in (
                    topic.event_type,
                    *([LEADER_FENCE] if topic.name in FENCED_TOPICS else []),
                )
            },
        }
    docs["asyncapi.json"] = {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Quartermaster events",
            "version": "1",
            "description": "Every message is a JSON envelope (envelope.json) whose `payload` "
            "is described per topic. job.submitted also accepts a bare job spec.",
        },
        "channels": channels,
        "components": {"messages": messages},
    }
    return docs


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def main(out: Path = DEFAULT_OUT) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for name, doc in documents().items():
        (out / name).write_text(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT))
