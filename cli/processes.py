"""Child processes in their own process groups: spawn them, check them, stop them for good.

Every server and service the dev stack starts gets its own session (``setsid``), so a
signal to the group also reaches anything it forked, and the terminal's Ctrl-C reaches
only ``qm`` — which then stops the children deliberately, in order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


def spawn(
    argv: Sequence[str],
    *,
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a session leader with stdout and stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...)."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may itself contain spaces or ')', so split after the last ')'.
    return raw[raw.rfind(")") + 2 :].split()


def cmdline(pid: int) -> str | None:
    """The process's command line joined by spaces, or None where /proc cannot tell."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def is_alive(pid: int, match: str | None = None) -> bool:
    """True if ``pid`` runs and, when ``match`` is given, its command line contains it.

    ``match`` guards against a pid recorded by an earlier run that the kernel has since
    handed to an unrelated process.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user (e.g. the embedded PostgreSQL's own user)
    fields = _stat_fields(pid)
    if fields is not None and fields[0] == "Z":
        return False  # a zombie has finished; only its parent has not collected it yet
    if match:
        line = cmdline(pid)
        if line is not None and match not in line:
            return False
    return True


def _pid_taken(pid: int) -> bool:
    """True if a live (non-zombie) process holds ``pid``, whoever it is."""
    return is_alive(pid)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``; empty without /proc."""
    members = []
    for entry in PROC.glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if fields and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return sorted(members)


@dataclass
class Target:
    """One process to stop: how to ask it, and whether its whole group goes with it."""

    pid: int
    sig: signal.Signals = signal.SIGTERM
    group: bool = True
    match: str | None = None
    process: subprocess.Popen[bytes] | None = None

    def running(self) -> bool:
        """True while the leader or anything left in its group still runs."""
        if self.pid <= 1:
            return False  # no real pid was recorded
        if self.process is not None:
            if self.process.poll() is None:
                return True
        elif is_alive(self.pid, self.match):
            return True
        if not self.group or _pid_taken(self.pid):
            # A live, different process holding the pid means the kernel reused it, which
            # it only does once our group is empty: nothing of ours is left.
            return False
        return bool(group_members(self.pid))

    def send(self, sig: signal.Signals) -> None:
        if self.pid <= 1:
            return  # killpg(0) would signal our own group, kill(-1) everything we may
        try:
            if self.group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_all(targets: Sequence[Target], timeout: float = 10.0) -> list[int]:
    """Ask every target to stop, wait up to ``timeout``, then SIGKILL what remains.

    Returns the pids that had to be killed. Signals go out together so that a slow
    service does not make the others wait for their turn.
    """
    live = [t for t in targets if t.running()]
    for target in live:
        target.send(target.sig)
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = [t for t in live if t.running()]
    for target in live:
        target.send(signal.SIGKILL)
        if not target.group:
            # The leader alone was asked; once forced, take its helpers with it too.
            target.group = True
            target.send(signal.SIGKILL)
            target.group = False
    deadline = time.monotonic() + 5.0
    while any(t.running() for t in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [t.pid for t in live]
