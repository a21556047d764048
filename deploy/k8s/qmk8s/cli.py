"""`render.py`: generate, render and check Quartermaster's manifests (docs/deploy.md)."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from qmk8s import generate, kustomize, lint, validate, wiring
from qmk8s.yamlio import ManifestError, Obj, dump_all

OVERLAYS = generate.K8S / "overlays"


@dataclass
class Report:
    overlay: str
    objects: list[Obj] = field(default_factory=list)
    problems: list[validate.Problem] = field(default_factory=list)  # schema and wiring
    findings: list[lint.Finding] = field(default_factory=list)

    @property
    def failing(self) -> list[lint.Finding]:
        return [f for f in self.findings if f.failing]

    @property
    def ok(self) -> bool:
        return not self.problems and not self.failing


def overlays() -> list[str]:
    return sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())


def render(overlay: str, *, allow_examples: bool = False) -> list[Obj]:
    return kustomize.build(OVERLAYS / overlay, allow_examples=allow_examples)


def check_objects(overlay: str, objects: list[Obj], version: str) -> Report:
    report = Report(overlay, objects)
    report.problems += validate.validate(objects, version)
    report.problems += wiring.check(objects)
    report.findings = lint.lint(objects)
    return report


def check_overlay(overlay: str, version: str = validate.KUBERNETES_VERSION) -> Report:
    """Render `overlay` (secrets from their .example files where the real ones are absent),
    validate it, check its wiring and lint it."""
    return check_objects(overlay, render(overlay, allow_examples=True), version)


def _print_report(report: Report, version: str, verbose: bool) -> None:
    custom = sum(
        1 for o in report.objects if (o.get("apiVersion"), o.get("kind")) in validate.CUSTOM
    )
    print(
        f"overlay {report.overlay}: {len(report.objects)} objects "
        f"({len(report.objects) - custom} against the Kubernetes {version} schemas, "
        f"{custom} custom resources against our structural checks)"
    )
    for problem in report.problems:
        print(f"  ERROR {problem}")
    for finding in report.failing:
        print(f"  LINT  {finding}")
    justified = [f for f in report.findings if not f.failing]
    if verbose:
        for finding in justified:
            print(f"  ok    {finding}")
    else:
        grouped: dict[tuple[str, str], int] = defaultdict(int)
        for finding in justified:
            grouped[(finding.rule, finding.justification or "")] += 1
        for (rule, reason), count in sorted(grouped.items()):
            print(f"  justified [{rule}] x{count}: {reason}")
    verdict = "ok" if report.ok else "FAILED"
    print(
        f"  {verdict}: {len(report.problems)} schema/wiring problems, "
        f"{len(report.failing)} lint findings, {len(justified)} justified"
    )


def cmd_generate(check: bool) -> int:
    if check:
        stale = generate.stale()
        for path in stale:
            print(f"stale: {path.relative_to(generate.ROOT)} (run `render.py generate`)")
        return 1 if stale else 0
    for path in generate.write():
        print(f"wrote {path.relative_to(generate.ROOT)}")
    return 0


def cmd_render(overlay: str, output: Path | None) -> int:
    text = dump_all(render(overlay))
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text)
    return 0


def cmd_check(names: list[str], version: str, verbose: bool) -> int:
    status = 0
    stale = generate.stale()
    if stale:
        status = 1
        for path in stale:
            print(f"ERROR stale generated file {path.relative_to(generate.ROOT)}: run generate")
    else:
        print(f"generated files: current ({len(generate.generated())})")
    for overlay in names or overlays():
        report = check_overlay(overlay, version)
        _print_report(report, version, verbose)
        if not report.ok:
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="render.py", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="write the generated files (topics, config copies)")
    gen.add_argument("--check", action="store_true", help="only report stale files")
    ren = sub.add_parser("render", help="print an overlay's objects, ready for kubectl apply")
    ren.add_argument("overlay", choices=overlays())
    ren.add_argument("-o", "--output", type=Path)
    chk = sub.add_parser("check", help="what CI runs: generated files, schemas, wiring, lint")
    chk.add_argument("overlays", nargs="*", help="default: every overlay")
    chk.add_argument("--kube-version", default=validate.KUBERNETES_VERSION)
    chk.add_argument("-v", "--verbose", action="store_true", help="list justified findings")
    parser.add_argument("--check", action="store_true", help="the same as the `check` command")
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args.check)
        if args.command == "render":
            return cmd_render(args.overlay, args.output)
        if args.command == "check":
            return cmd_check(args.overlays, args.kube_version, args.verbose)
        if args.check:
            return cmd_check([], validate.KUBERNETES_VERSION, False)
    except ManifestError as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return 1
    parser.print_help()
    return 2
