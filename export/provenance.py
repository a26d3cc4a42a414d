"""What every benchmark shares: the machine and the commit for its header, and timing a call."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent


def machine_description(gpu: str | None = None) -> str:
    """'2 CPU cores (AMD EPYC ...), no GPU, Linux 6.1...': the CPU model from /proc/cpuinfo."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpu or 'no GPU'}, {platform.system()} {platform.release()}"


def git_commit() -> str:
    """The short commit of this checkout, marked when tracked files have uncommitted changes."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = done.stdout.strip() or "unknown"
    return commit + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def timed(run, seconds: float, warmup: int = 2, min_calls: int = 5) -> float:
    """Median seconds per call of `run()` over at least `seconds` and `min_calls` calls (noise-robust)."""
    for _ in range(warmup):
        run()
    samples, started = [], time.perf_counter()
    while len(samples) < min_calls or time.perf_counter() - started < seconds:
        begin = time.perf_counter()
        run()
        samples.append(time.perf_counter() - begin)
    return float(np.median(samples))
