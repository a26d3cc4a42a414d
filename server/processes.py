"""The processes of a local server, read from /proc: a server started by TritonServer leads its own
process group, its Python stubs included. Used by the memory and speed benchmarks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_role(pid: int) -> str:
    """'tritonserver', or 'stub <model>' for a Python backend stub; '?' when the process is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    name = Path(argv[0].decode(errors="replace")).name
    if name == "triton_python_backend_stub" and len(argv) > 1:
        # argv[1] is .../<model>/<version>/model.py
        return f"stub {Path(argv[1].decode(errors='replace')).parent.parent.name}"
    return name


def _stat_fields(pid: int) -> list[str]:
    # The fields after the parenthesised command: state ppid pgrp session tty tpgid flags minflt
    # cminflt majflt cmajflt utime stime ...
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def group_pids(pgid: int) -> Iterator[int]:
    """The live processes of process group `pgid`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat_fields(int(entry.name))[2]) == pgid:
                yield int(entry.name)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile


def group_cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU time (user + system, all threads) used so far by each role of process group `pgid`;
    instances of one model add up."""
    totals: dict[str, float] = {}
    for pid in group_pids(pgid):
        try:
            fields = _stat_fields(pid)
            seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S
        except (OSError, ValueError, IndexError):
            continue
        role = process_role(pid)
        totals[role] = totals.get(role, 0.0) + seconds
    return totals
