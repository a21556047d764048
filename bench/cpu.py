"""Where the CPU goes during a benchmark: CPU seconds per process (each service, the broker,
PostgreSQL's backends) over a phase, and a sampling profile (py-spy) of every Python process
summarised as its top frames.

    meter = CpuMeter(processes)          # name -> pid
    meter.start(); ...; used = meter.stop()   # name -> CPU seconds over the phase
    with Profiler(processes, out_dir):   # py-spy record on each Python process meanwhile
        ...
    summary = summarise(out_dir)          # name -> top frames by self and total share

py-spy needs ptrace (root, or CAP_SYS_PTRACE); without it the profile is skipped with a
message and the CPU figures still stand.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

POSTGRES = "postgres"


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def memory_mb(processes: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """name -> {"rss": resident MB now, "peak": the most it was resident (Linux's VmHWM)} of
    each process still running; a process that is gone, or a platform without /proc, is left
    out."""
    out: dict[str, dict[str, float]] = {}
    for name, pid in processes.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(
            line.split(":", 1)
            for line in status.splitlines()
            if line.startswith(("VmRSS", "VmHWM"))
        )
        if "VmRSS" in fields and "VmHWM" in fields:
            out[name] = {
                "rss": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
                "peak": round(int(fields["VmHWM"].split()[0]) / 1024, 1),
            }
    return out


def postgres_backends() -> dict[int, psutil.Process]:
    """Every PostgreSQL process on the machine (the postmaster and its backends): the
    database serves the services, so its CPU belongs to the platform's bill."""
    out = {}
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            name = proc.info["name"] or ""
            cmd = " ".join(proc.info["cmdline"] or [])
        except (psutil.Error, TypeError):
            continue
        if name == POSTGRES or cmd.startswith("postgres:") or "/bin/postgres" in cmd:
            out[proc.pid] = proc
    return out


class CpuMeter:
    """CPU seconds per named process over a phase, plus all PostgreSQL processes together
    (backends come and go: one that starts during the phase counts whole, one that ends
    during it is missed, so the PostgreSQL figure is a lower bound)."""

    def __init__(self, processes: Mapping[str, int]) -> None:
        self.processes = {name: psutil.Process(pid) for name, pid in processes.items()}
        self._start: dict[str, float] = {}
        self._pg_start: dict[int, float] = {}

    def _read(self) -> dict[str, float]:
        out = {}
        for name, proc in self.processes.items():
            with contextlib.suppress(psutil.Error):
                out[name] = cpu_seconds(proc)
        return out

    def _read_pg(self) -> dict[int, float]:
        out = {}
        for pid, proc in postgres_backends().items():
            with contextlib.suppress(psutil.Error):
                out[pid] = cpu_seconds(proc)
        return out

    def start(self) -> None:
        self._start = self._read()
        self._pg_start = self._read_pg()

    def stop(self) -> dict[str, float]:
        end = self._read()
        used = {n: round(end[n] - self._start[n], 3) for n in end if n in self._start}
        pg_end = self._read_pg()
        used[POSTGRES] = round(sum(t - self._pg_start.get(p, 0.0) for p, t in pg_end.items()), 3)
        return used


class MachineMeter:
    """Over a phase: the cores the whole machine kept busy (every process, the kernel's work
    included), and the CPU seconds of this process, the bench's
    own client. Together with CpuMeter they tell whether a phase was bound by the cores: the
    machine near its core count, with the bench's share beside the stack's."""

    def __init__(self) -> None:
        self._times: Any = None
        self._own = 0.0
        self._wall = 0.0

    def start(self) -> None:
        self._times = psutil.cpu_times()
        self._own = cpu_seconds(psutil.Process())
        self._wall = time.monotonic()

    def stop(self) -> dict[str, float]:
        """{"busy_cores", "cores", "bench_cpu_s", "seconds"} since start()."""
        end, wall = psutil.cpu_times(), time.monotonic() - self._wall
        busy = _busy(end) - _busy(self._times)
        return {
            "busy_cores": round(busy / wall, 2) if wall > 0 else 0.0,
            "cores": float(psutil.cpu_count() or 0),
            "bench_cpu_s": round(cpu_seconds(psutil.Process()) - self._own, 3),
            "seconds": round(wall, 2),
        }


def _busy(times: Any) -> float:
    """CPU seconds spent running anything (guest time is already in user and nice, and time
    stolen by a hypervisor went to no one here)."""
    parts = ("user", "nice", "system", "irq", "softirq")
    return float(sum(getattr(times, p, 0.0) for p in parts))


def per_thousand(used: Mapping[str, float], jobs: int) -> dict[str, float]:
    """CPU seconds per 1,000 jobs: multiplied by a rate in thousands of jobs per second, the
    cores a process needs at that rate."""
    if jobs <= 0:
        return {}
    return {name: round(seconds * 1000 / jobs, 2) for name, seconds in used.items()}


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return found if Path(found).exists() else None


class Profiler:
    """py-spy record on every named Python process while the block runs; one raw (collapsed
    stacks) file per process in `out_dir`. Sampling runs in py-spy's own processes, so the
    services pay only the sampling interrupts (about 1-2% at 100 Hz)."""

    def __init__(self, processes: Mapping[str, int], out_dir: Path, rate_hz: int = 100) -> None:
        self.processes = dict(processes)
        self.out_dir = out_dir
        self.rate_hz = rate_hz
        self._spies: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Profiler:
        exe = py_spy()
        if exe is None:
            print("profile: py-spy not found (pip install py-spy); no profile taken")
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in self.processes.items():
            out = self.out_dir / f"{name}.txt"
            argv = [exe, "record", "-p", str(pid), "-r", str(self.rate_hz), "-f", "raw"]
            argv += ["--nonblocking", "-o", str(out)]
            self._spies.append(
                subprocess.Popen(
                    argv,
                    stdout=subprocess.DEVNULL,
                    stderr=(self.out_dir / f"{name}.err").open("wb"),
                )
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for spy in self._spies:  # py-spy writes its file on SIGINT
            with contextlib.suppress(ProcessLookupError):
                spy.send_signal(signal.SIGINT)
        for spy in self._spies:
            try:
                spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                spy.kill()


def read_collapsed(path: Path) -> Iterator[tuple[list[str], int]]:
    """(frames root first, samples) per line of a py-spy raw file."""
    with path.open() as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if stack and count.isdigit():
                yield stack.split(";"), int(count)


def _frame(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: lines differ sample to sample."""
    func, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(file).parts
    if "site-packages" in parts:
        file = "/".join(parts[parts.index("site-packages") + 1 :][:2])
    elif len(parts) > 2:
        file = "/".join(parts[-2:])
    return f"{func} ({file})"


# A loop waiting for I/O (selectors.select, a thread pool's idle wait) is not busy.
IDLE_FRAME = re.compile(r"(^|\.)(select|poll|epoll|wait|_wait_for_tstate_lock) \(")


# Frames every busy sample passes through (the event loop, the server, the runtime's guard):
# they say nothing about what the time is spent for.
PLUMBING = re.compile(
    r"\((asyncio/|<frozen |uvicorn/|runpy|threading\.py|concurrent/)"
    r"|^(<module>|serve|Runtime\._guard|Handle\._run|_guard) \("
)


def _plumbing(name: str) -> bool:
    return bool(PLUMBING.search(name))


def summarise_file(path: Path, top: int = 12) -> dict[str, Any]:
    """Top frames of one process by self share (where the time is spent) and by total share
    (what it is spent for), among busy samples (a loop waiting in select() is idle)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    busy = idle = 0
    for frames, count in read_collapsed(path):
        names = [_frame(f) for f in frames]
        if names and IDLE_FRAME.search(names[-1]):
            idle += count
            continue
        busy += count
        own[names[-1]] += count
        for name in set(names):
            total[name] += count
    share = (lambda c: round(100.0 * c / busy, 1)) if busy else (lambda c: 0.0)
    return {
        "samples": busy + idle,
        "busy_share": round(100.0 * busy / (busy + idle), 1) if busy + idle else 0.0,
        "self": [(name, share(c)) for name, c in own.most_common(top)],
        "total": [
            (name, share(c)) for name, c in total.most_common(top * 6) if not _plumbing(name)
        ][:top],
    }


def summarise(out_dir: Path, top: int = 12) -> dict[str, dict[str, Any]]:
    return {
        p.stem: summarise_file(p, top)
        for p in sorted(out_dir.glob("*.txt"))
        if p.stat().st_size > 0
    }


def print_summary(summary: Mapping[str, Mapping[str, Any]], cpu: Mapping[str, float]) -> str:
    """The summary as text (printed and written next to the raw files)."""
    lines = []
    for name in sorted(summary, key=lambda n: -cpu.get(n, 0.0)):
        s = summary[name]
        lines.append(
            f"\n== {name}: {cpu.get(name, float('nan')):.1f} CPU s, "
            f"{s['samples']} samples, {s['busy_share']}% busy"
        )
        lines.append("  self%   where the time is spent")
        lines += [f"  {pct:5.1f}   {frame}" for frame, pct in s["self"]]
        lines.append("  total%  what it is spent for")
        lines += [f"  {pct:5.1f}   {frame}" for frame, pct in s["total"]]
    text = "\n".join(lines)
    print(text)
    return text


def pids_of(stack: Any, kafka: Any | None = None) -> dict[str, int]:
    """name -> pid of every service of a `cli.stack.Stack` (and the broker when given)."""
    out = {s.name: s.pid for s in stack.services if s.pid}
    if kafka is not None and getattr(kafka, "pid", None):
        out["broker"] = kafka.pid
    return out


def is_python(pid: int) -> bool:
    try:
        return "python" in os.path.basename(psutil.Process(pid).exe())
    except psutil.Error:
        return False
