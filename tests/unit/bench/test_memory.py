"""The e2e bench's memory reading: resident and peak MB of each process still running."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.cpu import memory_mb


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
    _ = bytearray(64 << 20)  # 64 MB touched: the peak follows
    assert memory_mb({"me": os.getpid()})["me"]["peak"] >= me["rss"] + 60
