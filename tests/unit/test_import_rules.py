"""The package rules of ARCHITECTURE §1, checked on the import statements of every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> top-level modules it may import (besides the standard library and itself)
ALLOWED = {
    "schemas": {"pydantic", "pydantic_core", "schemas"},
    "core": {"schemas", "core", "numpy"},
    "sim": {"schemas", "core", "sim", "numpy", "matplotlib", "yaml", "click", "rich"},
}
SERVICES = sorted(
    p.name for p in (ROOT / "services").iterdir() if p.is_dir() and (p / "__init__.py").exists()
)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_pure_packages_import_only_what_they_may(package: str) -> None:
    import sys

    stdlib = sys.stdlib_module_names
    offenders = []
    for path in modules(package):
        for name in imports_of(path):
            top = name.split(".")[0]
            if top not in stdlib and top not in ALLOWED[package]:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


@pytest.mark.parametrize("service", [s for s in SERVICES if s != "common"])
def test_no_service_imports_another(service: str) -> None:
    offenders = []
    for path in modules(f"services/{service}"):
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] not in (service, "common"):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def test_common_imports_no_service() -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules("services/common")
        for name in imports_of(path)
        if name.startswith("services.") and not name.startswith("services.common")
    ]
    assert offenders == []


def test_the_rules_see_a_violation(tmp_path: Path) -> None:
    # Guard against a checker that passes because it reads nothing.
    bad = tmp_path / "bad.py"
    bad.write_text("import asyncpg\nfrom services.queue import store\n")
    assert imports_of(bad) == {"asyncpg", "services.queue"}
