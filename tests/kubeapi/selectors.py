"""Label and field selectors in the string forms clients send, parsed and matched as the API does.

Also the label key and value rules, which object validation shares: a label the API would refuse
must be refused here too, or a backend could ship labels that only the double accepts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_NAME_RE = re.compile(rf"^{_NAME}$")
_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SET_RE = re.compile(r"^(?P<key>[^\s=!<>(),]+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_BINARY_RE = re.compile(
    r"^(?P<key>[^\s=!<>(),]+)\s*(?P<op>==|=|!=|>|<)\s*(?P<value>[^\s=!<>(),]*)$"
)


class SelectorError(ValueError):
    """A selector the API would answer with 400 BadRequest."""


def label_key_error(key: str) -> str | None:
    """Why `key` is not a valid label (or annotation) key, or None: `[prefix/]name`, the prefix a
    DNS subdomain of at most 253 characters, the name at most 63 characters."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and not prefix:
        return "prefix part must be non-empty"
    if prefix and (len(prefix) > 253 or not _SUBDOMAIN_RE.match(prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if not name or len(name) > 63 or not _NAME_RE.match(name):
        return (
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
            "and end with an alphanumeric character (at most 63 characters)"
        )
    return None


def label_value_error(value: object) -> str | None:
    """Why `value` is not a valid label value, or None (empty is valid)."""
    if not isinstance(value, str):
        return "must be a string"
    if value and (len(value) > 63 or not _NAME_RE.match(value)):
        return (
            "a valid label must be an empty string or consist of alphanumeric characters, '-', "
            "'_' or '.', and must start and end with an alphanumeric character (at most 63)"
        )
    return None


@dataclass(frozen=True)
class Requirement:
    """One term of a label selector. `op` is one of =, !=, in, notin, exists, !exists, gt, lt."""

    key: str
    op: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        return present and _compare(value or "", self.op, self.values[0])


def _compare(value: str, op: str, bound: str) -> bool:
    try:
        number = int(value)
    except ValueError:
        return False  # the API treats a non-integer label as not matching gt/lt
    return number > int(bound) if op == "gt" else number < int(bound)


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(requirement.matches(labels) for requirement in self.requirements)


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b` is two terms."""
    terms, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            terms.append(text[start:index])
            start = index + 1
    terms.append(text[start:])
    return [term.strip() for term in terms]


def _parse_term(term: str) -> Requirement:
    if match := _SET_RE.match(term):
        values = tuple(value.strip() for value in match["values"].split(","))
        if values == ("",):
            raise SelectorError(f"for 'in', 'notin' operators, values set can't be empty: {term}")
        return Requirement(match["key"], match["op"], values)
    if match := _BINARY_RE.match(term):
        op = {"==": "=", ">": "gt", "<": "lt"}.get(match["op"], match["op"])
        if op in ("gt", "lt") and not re.fullmatch(r"-?\d+", match["value"]):
            raise SelectorError(f"for 'Gt', 'Lt' operators, the value must be an integer: {term}")
        return Requirement(match["key"], op, (match["value"],))
    if term.startswith("!"):
        return Requirement(term[1:].strip(), "!exists")
    if term and not any(char in term for char in " =!<>()"):
        return Requirement(term, "exists")
    raise SelectorError(f"unable to parse requirement: {term!r}")


def parse_label_selector(text: str | None) -> LabelSelector:
    """`a=b,c!=d,e in (x,y),f notin (z),g,!h,n>3`; an empty string selects everything."""
    if not text or not text.strip():
        return LabelSelector()
    requirements = []
    for term in _split_top_level(text):
        requirement = _parse_term(term)
        if error := label_key_error(requirement.key):
            raise SelectorError(f"invalid label key {requirement.key!r}: {error}")
        requirements.append(requirement)
    return LabelSelector(tuple(requirements))


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    equal: bool
    value: str


@dataclass(frozen=True)
class FieldSelector:
    requirements: tuple[FieldRequirement, ...] = ()

    @property
    def fields(self) -> set[str]:
        return {requirement.field for requirement in self.requirements}

    def matches(self, values: Mapping[str, str]) -> bool:
        return all(
            (values.get(req.field, "") == req.value) == req.equal for req in self.requirements
        )


def _split_escaped(text: str, separator: str) -> list[str]:
    """Split on `separator` unless backslash-escaped; escapes stay in for the next step."""
    parts, current, escaped = [], [], False
    for char in text:
        if escaped:
            current.append("\\" + char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == separator:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def _parse_field_term(term: str) -> FieldRequirement:
    # Find the first unescaped operator; values may contain escaped '=' and ','.
    index = 0
    while index < len(term):
        char = term[index]
        if char == "\\":
            index += 2
            continue
        for op, equal in (("!=", False), ("==", True), ("=", True)):
            if term.startswith(op, index):
                field = term[:index].strip()
                value = _unescape(term[index + len(op) :].strip())
                return FieldRequirement(field, equal, value)
        index += 1
    raise SelectorError(f"invalid selector: {term!r}; can't understand {term!r}")


def parse_field_selector(text: str | None) -> FieldSelector:
    """`metadata.name=x,spec.nodeName!=,status.phase==Running` (values may escape `\\,` `\\=`)."""
    if not text or not text.strip():
        return FieldSelector()
    terms = [term for term in _split_escaped(text, ",") if term.strip()]
    return FieldSelector(tuple(_parse_field_term(term) for term in terms))
