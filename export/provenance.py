"""Where a benchmark ran: the machine and the commit, for the header of every benchmark table."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path

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
