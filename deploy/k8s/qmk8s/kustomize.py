"""A small kustomize: the features deploy/k8s uses, with kustomize's meaning, so that CI renders
the overlays without kubectl. Anything else in a kustomization is refused, never ignored.

Kustomization fields:
  resources            YAML files (any number of documents) and directories with a kustomization
  configMapGenerator,  name, namespace, behavior (create | merge | replace), files (`KEY=PATH` or
  secretGenerator      `PATH`), literals (`KEY=VALUE`), envs (env files), type (Secrets), options
                       (disableNameSuffixHash, labels, annotations); generatorOptions the same
  patches              `path` or inline `patch`; a mapping is a strategic merge patch, a list a
                       JSON 6902 patch; `target` (group, version, kind, name, namespace as regular
                       expressions, labelSelector, annotationSelector) applies it to every match
  labels               `pairs` with `includeTemplates`; `includeSelectors` must be false
  images               name, newName, newTag, digest

Order inside one kustomization, as kustomize: resources and generators, then patches, then
labels, then images. Generated names get kustomize's content hash (`<name>-<10 characters>`,
the same hash kustomize computes) once, at the end of the top-level build, and references from
pod specs (volumes, env, envFrom, projected sources, imagePullSecrets) follow the new names.

Deliberate differences, all of them stricter:
  - a patch or a `target` that matches nothing is an error (kustomize skips a target quietly);
  - strategic merge knows the merge keys of the core kinds used here (containers, volumes, env,
    ports, volumeMounts, ...) instead of reading OpenAPI; custom resources merge as JSON merge
    patches (lists replaced, null deletes), which is what kustomize does without their schema;
  - a generator file that is missing while `<file>.example` exists is an error, unless the build
    allows examples (CI renders the prod overlay without its real secrets); the Secret is then
    annotated `quartermaster.io/rendered-from-example: "true"`.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qmk8s.yamlio import ManifestError, Obj, load_documents

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "configMapGenerator",
    "secretGenerator",
    "generatorOptions",
    "patches",
    "labels",
    "images",
}
FROM_EXAMPLE = "quartermaster.io/rendered-from-example"

# Core API groups, whose objects get strategic merge; anything else merges as JSON merge patch.
BUILTIN_GROUPS = {
    "",
    "apps",
    "batch",
    "policy",
    "autoscaling",
    "networking.k8s.io",
    "rbac.authorization.k8s.io",
}
# Lists merged element by element (by this key) under strategic merge; other lists are replaced.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
ObjId = tuple[str, str, str]  # kind, namespace ("" when cluster-scoped), name


def obj_id(obj: Obj) -> ObjId:
    meta = obj.get("metadata") or {}
    return (str(obj.get("kind", "")), str(meta.get("namespace") or ""), str(meta.get("name", "")))


def describe(oid: ObjId) -> str:
    kind, ns, name = oid
    return f"{kind} {ns}/{name}" if ns else f"{kind} {name}"


def group_of(obj: Obj) -> str:
    api = str(obj.get("apiVersion", ""))
    return api.split("/")[0] if "/" in api else ""


class KustomizeError(ManifestError):
    pass


@dataclass
class Generated:
    hashed: bool  # whether the name gets the content-hash suffix


@dataclass
class Build:
    objects: list[Obj] = field(default_factory=list)
    generated: dict[ObjId, Generated] = field(default_factory=dict)

    def find(self, oid: ObjId) -> Obj | None:
        return next((o for o in self.objects if obj_id(o) == oid), None)


# --- pod specs ----------------------------------------------------------------------------


def pod_templates(obj: Obj) -> Iterator[Obj]:
    """The pod templates of a workload (`{metadata, spec}` mappings)."""
    spec = obj.get("spec") or {}
    kind = obj.get("kind")
    if kind in WORKLOAD_KINDS and isinstance(spec.get("template"), dict):
        yield spec["template"]
    elif kind == "CronJob":
        template = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template")
        if isinstance(template, dict):
            yield template


def pod_specs(obj: Obj) -> Iterator[Obj]:
    if obj.get("kind") == "Pod" and isinstance(obj.get("spec"), dict):
        yield obj["spec"]
    for template in pod_templates(obj):
        if isinstance(template.get("spec"), dict):
            yield template["spec"]


def containers(pod_spec: Obj) -> Iterator[Obj]:
    for key in ("initContainers", "containers"):
        yield from pod_spec.get(key) or []


# --- the build ----------------------------------------------------------------------------


def find_kustomization(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def build(directory: Path, *, allow_examples: bool = False) -> list[Obj]:
    """Render the kustomization in `directory`: the objects, in apply order."""
    result = _build(directory.resolve(), allow_examples, stack=())
    _hash_and_rename(result)
    return sorted(result.objects, key=_apply_order)


def _build(directory: Path, allow_examples: bool, stack: tuple[Path, ...]) -> Build:
    if directory in stack:
        raise KustomizeError(f"{directory}: cycle through {' -> '.join(map(str, stack))}")
    path = find_kustomization(directory)
    docs = load_documents(path)
    if len(docs) != 1:
        raise KustomizeError(f"{path}: expected one document")
    kust = docs[0]
    unknown = set(kust) - SUPPORTED_FIELDS
    if unknown:
        raise KustomizeError(
            f"{path}: {', '.join(sorted(unknown))} not supported by this renderer "
            "(deploy/k8s/qmk8s/kustomize.py lists what is)"
        )
    result = Build()
    for entry in kust.get("resources") or []:
        target = (directory / str(entry)).resolve()
        if target.is_dir():
            _absorb(result, _build(target, allow_examples, (*stack, directory)), path)
        elif target.is_file():
            _absorb(result, Build(load_documents(target)), path)
        else:
            raise KustomizeError(f"{path}: resource {entry} does not exist")
    options = kust.get("generatorOptions") or {}
    for entry in kust.get("configMapGenerator") or []:
        _generate(result, "ConfigMap", entry, options, directory, allow_examples)
    for entry in kust.get("secretGenerator") or []:
        _generate(result, "Secret", entry, options, directory, allow_examples)
    for i, entry in enumerate(kust.get("patches") or []):
        _patch(result, entry, directory, f"{path} patches[{i}]")
    for entry in kust.get("labels") or []:
        _labels(result, entry, path)
    for entry in kust.get("images") or []:
        _images(result, entry, path)
    return result


def _absorb(into: Build, more: Build, where: Path) -> None:
    for obj in more.objects:
        oid = obj_id(obj)
        if not oid[0] or not oid[2]:
            raise KustomizeError(f"{where}: an object without kind or metadata.name")
        if into.find(oid) is not None:
            raise KustomizeError(f"{where}: {describe(oid)} is defined twice")
        into.objects.append(obj)
    into.generated.update(more.generated)


# --- generators ---------------------------------------------------------------------------


def _source(directory: Path, relative: str, allow_examples: bool) -> tuple[Path, bool]:
    """The file a generator reads, and whether it is the `.example` stand-in."""
    path = (directory / relative).resolve()
    if not path.is_relative_to(directory):
        # kustomize's load restrictor: a kustomization reads only files at or below its root.
        raise KustomizeError(f"{directory}: {relative} is outside the kustomization's directory")
    if path.is_file():
        return path, False
    example = path.with_name(path.name + ".example")
    if example.is_file():
        if allow_examples:
            return example, True
        raise KustomizeError(
            f"{path} is missing: copy {example.name} to {path.name} and fill in real values"
        )
    raise KustomizeError(f"{directory}: generator file {relative} does not exist")


def _pairs(text: str, where: str) -> list[tuple[str, str]]:
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key:
            raise KustomizeError(f"{where}:{n}: expected KEY=VALUE")
        out.append((key, value))
    return out


def _literal(text: str, where: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise KustomizeError(f"{where}: literal {text!r} is not KEY=VALUE")
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return key, value


def _generate(
    result: Build, kind: str, entry: Obj, options: Obj, directory: Path, allow_examples: bool
) -> None:
    name = entry.get("name")
    where = f"{directory} {kind} generator {name}"
    if not name:
        raise KustomizeError(f"{directory}: a {kind} generator without a name")
    known = {"name", "namespace", "behavior", "files", "literals", "envs", "type", "options"}
    if set(entry) - known:
        raise KustomizeError(f"{where}: unsupported {', '.join(sorted(set(entry) - known))}")
    data: dict[str, str] = {}
    from_example = False
    for literal in entry.get("literals") or []:
        key, value = _literal(str(literal), where)
        data[key] = value
    for env in entry.get("envs") or []:
        path, example = _source(directory, str(env), allow_examples)
        from_example |= example
        data.update(_pairs(path.read_text(), str(path)))
    for spec in entry.get("files") or []:
        key, sep, rel = str(spec).partition("=")
        if not sep:
            key, rel = Path(key).name, key
        path, example = _source(directory, rel, allow_examples)
        from_example |= example
        data[key] = path.read_text()
    opts = {**options, **(entry.get("options") or {})}
    meta: Obj = {"name": name}
    if entry.get("namespace"):
        meta["namespace"] = entry["namespace"]
    if opts.get("labels"):
        meta["labels"] = dict(opts["labels"])
    annotations = dict(opts.get("annotations") or {})
    if from_example:
        annotations[FROM_EXAMPLE] = "true"
    if annotations:
        meta["annotations"] = annotations
    obj: Obj = {"apiVersion": "v1", "kind": kind, "metadata": meta}
    if kind == "Secret":
        obj["type"] = entry.get("type") or "Opaque"
        obj["data"] = {k: secret_value(v) for k, v in data.items()}
    else:
        obj["data"] = data
    oid = obj_id(obj)
    hashed = not opts.get("disableNameSuffixHash", False)
    behavior = entry.get("behavior") or "create"
    existing = result.find(oid)
    if behavior == "create":
        if existing is not None:
            raise KustomizeError(f"{where}: {describe(oid)} exists (use behavior merge/replace)")
        result.objects.append(obj)
        result.generated[oid] = Generated(hashed)
        return
    if behavior not in ("merge", "replace"):
        raise KustomizeError(f"{where}: unknown behavior {behavior}")
    if existing is None or oid not in result.generated:
        raise KustomizeError(f"{where}: behavior {behavior} needs a generated {describe(oid)}")
    if behavior == "replace":
        existing["data"] = obj["data"]
    else:
        existing.setdefault("data", {}).update(obj["data"])
    for key in ("labels", "annotations"):
        if key in meta:
            existing["metadata"].setdefault(key, {}).update(meta[key])
    if "disableNameSuffixHash" in opts:
        result.generated[oid] = Generated(hashed)


def secret_value(text: str) -> str:
    """Base64 as kustomize writes it into a Secret: in lines of 70 characters, each ended by a
    newline, once it is 70 characters or longer (the hash is taken over that text)."""
    encoded = base64.b64encode(text.encode()).decode()
    if len(encoded) < 70:
        return encoded
    return "".join(encoded[i : i + 70] + "\n" for i in range(0, len(encoded), 70))


def _go_json(value: Any) -> str:
    """JSON as Go's encoding/json writes it (sorted keys, no spaces, HTML characters escaped),
    which is what kustomize hashes."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escaped)
    return text


def content_hash(obj: Obj) -> str:
    """kustomize's name suffix for a generated ConfigMap or Secret: sha256 of the JSON of kind,
    type, name and data. kustomize's hasher looks the name up as one field called
    `metadata/name`, finds none and hashes an empty name; so does this, to give the same
    suffixes (compared with `kubectl kustomize` 5.5 by tests/unit/deploy)."""
    name = ""
    # A field the object lacks is hashed as an empty string, as kustomize does.
    data = obj.get("data", "")
    if obj["kind"] == "ConfigMap":
        encoded: Obj = {"kind": "ConfigMap", "name": name, "data": data}
        if isinstance(obj.get("binaryData"), dict):
            encoded["binaryData"] = obj["binaryData"]
    else:
        encoded = {"kind": "Secret", "type": obj.get("type", ""), "name": name, "data": data}
        if isinstance(obj.get("stringData"), dict):
            encoded["stringData"] = obj["stringData"]
    digest = hashlib.sha256(_go_json(encoded).encode()).hexdigest()[:10]
    # kustomize swaps a few characters so that the suffix never spells a word.
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _hash_and_rename(result: Build) -> None:
    renamed: dict[tuple[str, str, str], str] = {}
    for oid, gen in result.generated.items():
        obj = result.find(oid)
        if obj is None or not gen.hashed:
            continue
        new = f"{oid[2]}-{content_hash(obj)}"
        obj["metadata"]["name"] = new
        renamed[oid] = new
    if not renamed:
        return
    for obj in result.objects:
        ns = str((obj.get("metadata") or {}).get("namespace") or "")
        for spec in pod_specs(obj):
            _rename_refs(spec, ns, renamed)


def _rename_refs(spec: Obj, ns: str, renamed: dict[tuple[str, str, str], str]) -> None:
    def fix(holder: Obj | None, key: str, kind: str) -> None:
        if isinstance(holder, dict) and (kind, ns, holder.get(key)) in renamed:
            holder[key] = renamed[(kind, ns, holder[key])]

    for volume in spec.get("volumes") or []:
        fix(volume.get("configMap"), "name", "ConfigMap")
        fix(volume.get("secret"), "secretName", "Secret")
        for source in (volume.get("projected") or {}).get("sources") or []:
            fix(source.get("configMap"), "name", "ConfigMap")
            fix(source.get("secret"), "name", "Secret")
    for pull in spec.get("imagePullSecrets") or []:
        fix(pull, "name", "Secret")
    for container in containers(spec):
        for env in container.get("env") or []:
            ref = env.get("valueFrom") or {}
            fix(ref.get("configMapKeyRef"), "name", "ConfigMap")
            fix(ref.get("secretKeyRef"), "name", "Secret")
        for source in container.get("envFrom") or []:
            fix(source.get("configMapRef"), "name", "ConfigMap")
            fix(source.get("secretRef"), "name", "Secret")


# --- patches ------------------------------------------------------------------------------


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        if "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def target_matches(obj: Obj, target: Obj) -> bool:
    api = str(obj.get("apiVersion", ""))
    group, _, version = api.rpartition("/")
    meta = obj.get("metadata") or {}
    checks = {
        "group": group,
        "version": version,
        "kind": str(obj.get("kind", "")),
        "name": str(meta.get("name", "")),
        "namespace": str(meta.get("namespace") or ""),
    }
    for key, actual in checks.items():
        if key in target and not re.fullmatch(str(target[key]), actual):
            return False
    if "labelSelector" in target and not _selector_matches(
        str(target["labelSelector"]), meta.get("labels") or {}
    ):
        return False
    return "annotationSelector" not in target or _selector_matches(
        str(target["annotationSelector"]), meta.get("annotations") or {}
    )


def _patch(result: Build, entry: Obj, directory: Path, where: str) -> None:
    unknown = set(entry) - {"path", "patch", "target"}
    if unknown:
        raise KustomizeError(f"{where}: unsupported {', '.join(sorted(unknown))}")
    if "path" in entry:
        path, _ = _source(directory, str(entry["path"]), allow_examples=False)
        text, where = path.read_text(), f"{where} ({path.name})"
    elif "patch" in entry:
        text = str(entry["patch"])
    else:
        raise KustomizeError(f"{where}: needs `path` or `patch`")
    target = entry.get("target")
    docs = [d for d in _all_docs(text, where) if d is not None]
    if len(docs) == 1 and isinstance(docs[0], list):
        if not target:
            raise KustomizeError(f"{where}: a JSON 6902 patch needs a target")
        for obj in _targets(result, target, where):
            _replace(result, obj, json6902(obj, docs[0], where))
        return
    for doc in docs:
        if not isinstance(doc, dict):
            raise KustomizeError(f"{where}: a patch must be a mapping or a list")
        if target:
            matched = _targets(result, target, where)
        else:
            matched = [o for o in result.objects if _same_object(o, doc)]
            if len(matched) != 1:
                what = f"{doc.get('kind')} {(doc.get('metadata') or {}).get('name')}"
                raise KustomizeError(f"{where}: {what} matches {len(matched)} objects")
        for obj in matched:
            if doc.get("$patch") == "delete":
                result.objects.remove(obj)
                result.generated.pop(obj_id(obj), None)
                continue
            patch = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
            if target:
                patch = copy.deepcopy(patch)
                (patch.get("metadata") or {}).pop("name", None)
                (patch.get("metadata") or {}).pop("namespace", None)
            merged = strategic_merge(obj, patch, group_of(obj) in BUILTIN_GROUPS)
            _replace(result, obj, merged)


def _all_docs(text: str, where: str) -> list[Any]:
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise KustomizeError(f"{where}: {exc}") from exc


def _same_object(obj: Obj, patch: Obj) -> bool:
    meta, pmeta = obj.get("metadata") or {}, patch.get("metadata") or {}
    if obj.get("kind") != patch.get("kind") or meta.get("name") != pmeta.get("name"):
        return False
    if group_of(obj) != group_of(patch):
        return False
    return "namespace" not in pmeta or meta.get("namespace") == pmeta["namespace"]


def _targets(result: Build, target: Obj, where: str) -> list[Obj]:
    unknown = set(target) - {
        "group",
        "version",
        "kind",
        "name",
        "namespace",
        "labelSelector",
        "annotationSelector",
    }
    if unknown:
        raise KustomizeError(f"{where}: unsupported target {', '.join(sorted(unknown))}")
    matched = [o for o in result.objects if target_matches(o, target)]
    if not matched:
        raise KustomizeError(f"{where}: target {target} matches nothing")
    return matched


def _replace(result: Build, old: Obj, new: Obj) -> None:
    index = next(i for i, o in enumerate(result.objects) if o is old)
    if obj_id(new) != obj_id(old):
        raise KustomizeError(f"a patch may not rename {describe(obj_id(old))}")
    result.objects[index] = new


def strategic_merge(obj: Any, patch: Any, strategic: bool, key: str = "") -> Any:
    """Merge `patch` into a copy of `obj`: strategic merge for core kinds, else JSON merge."""
    if not isinstance(patch, dict):
        if isinstance(patch, list) and isinstance(obj, list) and strategic:
            return _merge_list(obj, patch, key)
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    directives = [k for k in patch if k.startswith("$") and k != "$patch"]
    if directives:
        raise KustomizeError(f"unsupported strategic merge directive {directives[0]}")
    out = copy.deepcopy(obj) if isinstance(obj, dict) else {}
    for k, v in patch.items():
        if k == "$patch":
            continue
        if v is None:
            out.pop(k, None)
        else:
            out[k] = strategic_merge(out.get(k), v, strategic, k)
    return out


def _merge_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    merge_key = MERGE_KEYS.get(key)
    if key == "ports" and patch and isinstance(patch[0], dict):
        merge_key = "containerPort" if "containerPort" in patch[0] else "port"
    if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
        return [copy.deepcopy(p) for p in patch if not (isinstance(p, dict) and "$patch" in p)]
    if merge_key is None or not all(isinstance(p, dict) and merge_key in p for p in patch):
        return copy.deepcopy(patch)
    out = copy.deepcopy(current)
    for item in patch:
        index = next(
            (
                i
                for i, c in enumerate(out)
                if isinstance(c, dict) and c.get(merge_key) == item[merge_key]
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                out.pop(index)
            continue
        if index is None:
            out.append({k: copy.deepcopy(v) for k, v in item.items() if k != "$patch"})
        else:
            out[index] = strategic_merge(out[index], item, True)
    return out


def _pointer(path: str, where: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"{where}: JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], where: str) -> Any:
    for part in parts:
        if isinstance(doc, list):
            try:
                doc = doc[int(part)]
            except (ValueError, IndexError) as exc:
                raise KustomizeError(f"{where}: no element {part}") from exc
        elif isinstance(doc, dict) and part in doc:
            doc = doc[part]
        else:
            raise KustomizeError(f"{where}: no member {part!r}")
    return doc


def json6902(obj: Obj, ops: list[Any], where: str) -> Obj:
    """Apply a JSON patch (RFC 6902) to a copy of `obj`."""
    doc = copy.deepcopy(obj)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise KustomizeError(f"{where}: each operation needs `op` and `path`")
        name, parts = op["op"], _pointer(str(op["path"]), where)
        if name in ("add", "replace", "test") and "value" not in op:
            raise KustomizeError(f"{where}: {name} needs a value")
        if name == "test":
            if _walk(doc, parts, where) != op["value"]:
                raise KustomizeError(f"{where}: test of {op['path']} failed")
            continue
        if name in ("move", "copy"):
            source = _pointer(str(op.get("from", "")), where)
            value = copy.deepcopy(_walk(doc, source, where))
            if name == "move":
                doc = _remove(doc, source, where)
            doc = _add(doc, parts, value, where, replace=False)
        elif name == "remove":
            doc = _remove(doc, parts, where)
        elif name in ("add", "replace"):
            if name == "replace":
                _walk(doc, parts, where)  # must exist
            doc = _add(doc, parts, copy.deepcopy(op["value"]), where, replace=name == "replace")
        else:
            raise KustomizeError(f"{where}: unknown op {name}")
    return doc


def _add(doc: Any, parts: list[str], value: Any, where: str, *, replace: bool) -> Any:
    if not parts:
        return value
    parent = _walk(doc, parts[:-1], where)
    last = parts[-1]
    if isinstance(parent, list):
        if last == "-":
            parent.append(value)
            return doc
        try:
            index = int(last)
        except ValueError as exc:
            raise KustomizeError(f"{where}: bad index {last!r}") from exc
        if replace:
            parent[index] = value
        elif 0 <= index <= len(parent):
            parent.insert(index, value)
        else:
            raise KustomizeError(f"{where}: index {index} out of range")
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise KustomizeError(f"{where}: cannot add under a scalar")
    return doc


def _remove(doc: Any, parts: list[str], where: str) -> Any:
    if not parts:
        raise KustomizeError(f"{where}: cannot remove the whole object")
    parent = _walk(doc, parts[:-1], where)
    _walk(parent, parts[-1:], where)
    if isinstance(parent, list):
        parent.pop(int(parts[-1]))
    else:
        del parent[parts[-1]]
    return doc


# --- labels and images --------------------------------------------------------------------


def _labels(result: Build, entry: Obj, where: Path) -> None:
    unknown = set(entry) - {"pairs", "includeSelectors", "includeTemplates"}
    if unknown:
        raise KustomizeError(f"{where}: labels: unsupported {', '.join(sorted(unknown))}")
    if entry.get("includeSelectors"):
        raise KustomizeError(
            f"{where}: labels.includeSelectors is not supported (selectors are immutable; "
            "select on app.kubernetes.io/name)"
        )
    pairs = {str(k): str(v) for k, v in (entry.get("pairs") or {}).items()}
    for obj in result.objects:
        obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        if entry.get("includeTemplates"):
            for template in pod_templates(obj):
                template.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """name, tag, digest of an image reference."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def _images(result: Build, entry: Obj, where: Path) -> None:
    unknown = set(entry) - {"name", "newName", "newTag", "digest"}
    if unknown or "name" not in entry:
        raise KustomizeError(f"{where}: images entries need `name` (and newName/newTag/digest)")
    for obj in result.objects:
        for spec in pod_specs(obj):
            for container in containers(spec):
                name, tag, digest = split_image(str(container.get("image", "")))
                if name != entry["name"]:
                    continue
                name = str(entry.get("newName", name))
                if "newTag" in entry:
                    tag, digest = str(entry["newTag"]), None
                if "digest" in entry:
                    digest = str(entry["digest"])
                image = name + (f":{tag}" if tag and not digest else "")
                container["image"] = image + (f"@{digest}" if digest else "")


# --- order --------------------------------------------------------------------------------

_ORDER = [
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
]


def _apply_order(obj: Obj) -> tuple[int, str, str, str]:
    kind, ns, name = obj_id(obj)
    rank = _ORDER.index(kind) if kind in _ORDER else len(_ORDER)
    return (rank, kind, ns, name)
