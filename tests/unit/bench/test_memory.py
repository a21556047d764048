"""The e2e bench's memory reading: resident and peak MB of each process still running."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.cpu import memory_mb

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
