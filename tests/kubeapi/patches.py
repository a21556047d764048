"""The three patch formats the API accepts from kubernetes-asyncio, applied to plain JSON values.

All functions work on a document the caller owns (a fresh copy of the stored object) and may
change it in place; they return the patched document.

Strategic merge is simplified: maps merge as in a JSON merge patch; the lists the Kubernetes
types mark with a merge key (containers, env, volumes, schedulingGates, conditions, ...) merge
item by item on that key (`$patch: delete` removes an item, `$patch: replace` replaces the list);
`metadata.finalizers` merges as a set (with `$deleteFromPrimitiveList/finalizers`); every other
list is replaced, which is what the real types say for most of them (taints, tolerations, args).
The key is chosen by the field's name, not its full path, and `ports` lists are replaced, not
merged (their key differs between containers and services). `$setElementOrder` and
`$retainKeys` are ignored.
"""

from __future__ import annotations

import json
from typing import Any

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCHES = ("application/apply-patch+yaml", "application/apply-patch+cbor")

# Lists of objects that strategic merge combines by a key, by field name.
LIST_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "schedulingGates": "name",
    "conditions": "type",
    "addresses": "type",
    "ownerReferences": "uid",
}
# Lists of strings that strategic merge combines as sets.
PRIMITIVE_MERGE_LISTS = {"finalizers"}
_DELETE_FROM_PRIMITIVE = "$deleteFromPrimitiveList/"


class PatchError(Exception):
    """A patch the API refuses: 400 when it cannot be read, 422 when it cannot be applied."""

    def __init__(self, message: str, code: int = 422) -> None:
        super().__init__(message)
        self.code = code


def clone(value: Any) -> Any:
    """A deep copy of a JSON value (faster than copy.deepcopy for plain JSON)."""
    return json.loads(json.dumps(value))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    result = target if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, field: str | None = None) -> Any:
    """Kubernetes strategic merge, simplified as the module docstring says."""
    if isinstance(patch, list):
        return _merge_list(target, patch, field)
    if not isinstance(patch, dict):
        return patch
    if patch.get("$patch") == "replace":
        return {key: value for key, value in patch.items() if key != "$patch"}
    result = target if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        else:
            result[key] = strategic_merge_patch(result.get(key), value, key)
    for key, value in patch.items():
        if key.startswith(_DELETE_FROM_PRIMITIVE):
            name = key[len(_DELETE_FROM_PRIMITIVE) :]
            result[name] = [item for item in result.get(name) or [] if item not in value]
    return result


def _merge_list(target: Any, patch: list[Any], field: str | None) -> list[Any]:
    if not isinstance(target, list):
        return [_strip_directive(item) for item in patch if not _is_delete(item)]
    if field in PRIMITIVE_MERGE_LISTS:
        return target + [item for item in patch if item not in target]
    key = LIST_MERGE_KEYS.get(field or "")
    if key is None:
        return patch
    if any(_directive(item) == "replace" for item in patch):
        return [_strip_directive(item) for item in patch if _directive(item) != "replace"]
    return _merge_keyed(target, patch, key)


def _merge_keyed(target: list[Any], patch: list[Any], key: str) -> list[Any]:
    result = list(target)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"map: {item!r} does not contain declared merge key: {key}", 400)
        position = next(
            (
                i
                for i, old in enumerate(result)
                if isinstance(old, dict) and old.get(key) == item[key]
            ),
            None,
        )
        if _is_delete(item):
            if position is not None:
                del result[position]
        elif position is None:
            result.append(_strip_directive(item))
        else:
            result[position] = strategic_merge_patch(result[position], item)
    return result


def _directive(item: Any) -> Any:
    return item.get("$patch") if isinstance(item, dict) else None


def _is_delete(item: Any) -> bool:
    return _directive(item) == "delete"


def _strip_directive(item: Any) -> Any:
    if isinstance(item, dict):
        return {key: value for key, value in item.items() if key != "$patch"}
    return item


def json_patch(document: Any, operations: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy and test, applied in order."""
    if not isinstance(operations, list):
        raise PatchError("json patch must be a JSON array of operations", 400)
    for operation in operations:
        if not isinstance(operation, dict) or "op" not in operation or "path" not in operation:
            raise PatchError(f"invalid json patch operation: {operation!r}", 400)
        document = _apply_operation(document, operation)
    return document


def _apply_operation(document: Any, operation: dict[str, Any]) -> Any:
    op, path = operation["op"], operation["path"]
    if op in ("add", "replace", "test") and "value" not in operation:
        raise PatchError(f"{op} operation does not apply: missing value for path {path}", 400)
    if op == "add":
        return _add(document, path, clone(operation["value"]))
    if op == "remove":
        return _remove(document, path)[0]
    if op == "replace":
        _get(document, path)  # replace requires the target to exist
        if path == "":
            return clone(operation["value"])
        return _add(_remove(document, path)[0], path, clone(operation["value"]))
    if op == "test":
        if _get(document, path) != operation["value"]:
            raise PatchError(f"testing value {path} failed")
        return document
    if op in ("move", "copy"):
        source = operation.get("from")
        if not isinstance(source, str):
            raise PatchError(f"{op} operation needs a 'from' path", 400)
        value = clone(_get(document, source))
        if op == "move":
            document = _remove(document, source)[0]
        return _add(document, path, value)
    raise PatchError(f"unexpected json patch operation: {op!r}", 400)


def _tokens(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"json pointer must start with '/': {path!r}", 400)
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _index(container: list[Any], token: str, path: str, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchError(f"invalid array index {token!r} in path {path}")
    index = int(token)
    if index > len(container) or (index == len(container) and not allow_end):
        raise PatchError(f"array index {index} out of bounds in path {path}")
    return index


def _parent(document: Any, path: str) -> tuple[Any, str]:
    tokens = _tokens(path)
    node = document
    for token in tokens[:-1]:
        node = _child(node, token, path)
    return node, tokens[-1]


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise PatchError(f"path {path} does not exist: missing key {token!r}")
        return node[token]
    if isinstance(node, list):
        return node[_index(node, token, path, allow_end=False)]
    raise PatchError(f"path {path} does not exist: {token!r} is inside a scalar")


def _get(document: Any, path: str) -> Any:
    node = document
    for token in _tokens(path):
        node = _child(node, token, path)
    return node


def _add(document: Any, path: str, value: Any) -> Any:
    if path == "":
        return value
    parent, token = _parent(document, path)
    if isinstance(parent, dict):
        parent[token] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, token, path, allow_end=True), value)
    else:
        raise PatchError(f"add operation does not apply: {path} is inside a scalar")
    return document


def _remove(document: Any, path: str) -> tuple[Any, Any]:
    if path == "":
        raise PatchError("cannot remove the whole document")
    parent, token = _parent(document, path)
    if isinstance(parent, dict):
        if token not in parent:
            raise PatchError(f"remove operation does not apply: doc is missing path: {path}")
        return document, parent.pop(token)
    if isinstance(parent, list):
        return document, parent.pop(_index(parent, token, path, allow_end=False))
    raise PatchError(f"remove operation does not apply: {path} is inside a scalar")


def apply_patch(content_type: str, document: Any, patch: Any) -> Any:
    """Apply `patch` in the format `content_type` names (without parameters) to `document`."""
    if content_type == MERGE_PATCH:
        return merge_patch(document, patch)
    if content_type == STRATEGIC_MERGE_PATCH:
        return strategic_merge_patch(document, patch)
    if content_type == JSON_PATCH:
        return json_patch(document, patch)
    raise PatchError(f"unsupported patch type {content_type!r}", 415)
