"""How long `qm` takes from a fresh interpreter to its answer.

Runs each command in a new Python process, as a user's shell does: `qm list` against a local
HTTP server that answers with 50 jobs (start, request and the rendered table), `qm list`
against a closed port (start and request only), `qm --help` and `qm list --help`. Prints the
median and range of each, and a bare interpreter's start for comparison.

    python bench/cli_start.py                  # 15 runs of each
    python bench/cli_start.py --runs 30
    python bench/cli_start.py --tree /path/to/another/checkout   # the same commands there,
                                                                 # alternated with this one

`--tree` compares two checkouts in one run (each run of a command alternates between them), so
that a change is measured against the code before it on the same machine at the same moment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QM = "import sys; from cli.main import app; app(sys.argv[1:], prog_name='qm')"


def jobs_answer(count: int) -> bytes:
    states = ("queued", "running", "succeeded")
    jobs = [
        {
            "job_id": f"j-{i:04d}",
            "name": f"train-{i}",
            "tenant": "vision",
            "state": states[i % 3],
            "queue": "default",
            "priority_class": "normal",
            "submitted_at": "2026-11-26T10:00:00Z",
            "accelerators": 8,
            "accelerator_types": ["H100"],
            "replicas": 1,
        }
        for i in range(count)
    ]
    return json.dumps({"jobs": jobs}).encode()


def serve(body: bytes) -> ThreadingHTTPServer:
    class Answer(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed


def once(tree: Path, args: list[str], expect: tuple[int, str]) -> float:
    """Wall seconds of one `qm` run; refuses a run that did not do what it should (a command
    that crashed early would look fast)."""
    env = {**os.environ, "QM_STATE_DIR": "/nonexistent", "COLUMNS": "120", "NO_COLOR": "1"}
    env.pop("QM_GATEWAY_URL", None)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", QM, *args], cwd=tree, env=env, capture_output=True, check=False
    )
    took = time.perf_counter() - start
    code, text = expect
    said = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
    if done.returncode != code or text not in said:
        raise SystemExit(
            f"qm {' '.join(args)} in {tree}: exit {done.returncode}, expected {code} and "
            f"{text!r} in its output:\n{said[-2000:]}"
        )
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh processes per command")
    parser.add_argument("--tree", type=Path, help="another checkout to alternate with")
    args = parser.parse_args()

    server = serve(jobs_answer(50))
    gateway = f"http://127.0.0.1:{server.server_address[1]}"
    commands = {
        "list": ["list", "--gateway", gateway],
        "list_unreachable": ["list", "--gateway", f"http://127.0.0.1:{closed_port()}"],
        "help": ["--help"],
        "list_help": ["list", "--help"],
    }
    # (exit code, text in the output) each run must show
    expected = {
        "list": (0, "j-0049"),
        "list_unreachable": (1, "cannot reach the gateway"),
        "help": (0, "submit"),
        "list_help": (0, "--limit"),
    }
    trees = {"this": ROOT, **({"other": args.tree.resolve()} if args.tree else {})}
    times: dict[str, dict[str, list[float]]] = {t: {c: [] for c in commands} for t in trees}
    bare: list[float] = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.perf_counter() - start)
        for name, argv in commands.items():
            for tree_name, tree in trees.items():
                times[tree_name][name].append(once(tree, argv, expected[name]))
    server.shutdown()

    print(
        f"fresh interpreters, {args.runs} runs each; bare python: "
        f"{statistics.median(bare) * 1000:.0f} ms"
    )
    figures: dict[str, dict[str, float]] = {}
    for tree_name, per_command in times.items():
        label = str(trees[tree_name])
        figures[tree_name] = {}
        for name, values in per_command.items():
            ms = sorted(v * 1000 for v in values)
            figures[tree_name][f"{name}_ms"] = round(statistics.median(ms), 1)
            median = statistics.median(ms)
            spread = f"(min {ms[0]:.0f}, max {ms[-1]:.0f})"
            print(f"{label:28s} {name:17s} median {median:4.0f} ms {spread}")
    result = {
        "bench": "cli_start",
        "qm_list_ms": figures["this"]["list_ms"],
        **figures["this"],
        **({"other": figures["other"]} if "other" in figures else {}),
        "bare_python_ms": round(statistics.median(bare) * 1000, 1),
        "setup": {
            "cores": os.cpu_count(),
            "runs": args.runs,
            "jobs_listed": 50,
            "python": platform.python_version(),
            "trees": {k: str(v) for k, v in trees.items()},
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
