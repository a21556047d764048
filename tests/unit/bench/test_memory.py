"""The e2e bench's readings of the machine: resident and peak MB of each process still
running, and the cores the whole machine kept busy beside the bench's own CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.cpu import MachineMeter, memory_mb

# A child that maps 64 MB of anonymous memory, touches every page, unmaps it, then waits.
# The peak must keep the 64 MB and the resident size must have dropped them. It is measured
# in a child of its own, not in the test process: pytest's resident size moves by megabytes
# at any moment (its collector, the allocator handing pages back), which once made the peak
# look 4 MB short of "resident before + 64".
_TOUCH_AND_RELEASE = """
import mmap, sys
m = mmap.mmap(-1, 64 << 20)
for i in range(0, 64 << 20, mmap.PAGESIZE):
    m[i] = 1
m.close()
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_running_process_is_read_and_a_gone_one_left_out() -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    got = memory_mb({"me": os.getpid(), "gone": int(gone.stdout)})
    assert set(got) == {"me"}
    me = got["me"]
    assert 10 < me["rss"] <= me["peak"]  # a Python process holds more than 10 MB


def test_the_peak_keeps_memory_that_was_resident_and_given_back() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _TOUCH_AND_RELEASE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        got = memory_mb({"child": child.pid})["child"]
    finally:
        child.communicate("")
    assert got["peak"] >= 64
    assert got["peak"] - got["rss"] >= 60  # the 64 MB were resident once and are no longer


def test_the_machine_reading_counts_the_bench_own_cpu_within_the_machines() -> None:
    whole = MachineMeter()
    whole.start()
    spent = time.process_time() + 0.3
    while time.process_time() < spent:  # 0.3 CPU s of this process, however long it takes
        pass
    got = whole.stop()
    assert got["bench_cpu_s"] >= 0.27  # /proc counts in ticks of 10 ms
    assert got["cores"] >= 1
    # The machine's busy time includes this process's: never less (within ticks and rounding).
    assert got["busy_cores"] * got["seconds"] >= got["bench_cpu_s"] - 0.05
