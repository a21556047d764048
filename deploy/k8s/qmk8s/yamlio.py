"""Reading and writing Kubernetes YAML: every document a mapping, output stable and readable
(multi-line strings as literal blocks, keys in the order they were written)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]


class ManifestError(Exception):
    """A manifest that cannot be read or rendered (with the file and the reason)."""


def load_documents(path: Path) -> list[Obj]:
    """The non-empty documents of a YAML file; each must be a mapping."""
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f"{path}: {exc}") from exc
    out: list[Obj] = []
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ManifestError(f"{path}: document {i + 1} is not a mapping")
        out.append(doc)
    return out


def load_text(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(f"{where}: {exc}") from exc


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str)


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def dump_all(objs: Iterable[Obj]) -> str:
    return "---\n".join(dump(o) for o in objs)
