"""A server's errors, log tail and process group."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


class ServerError(RuntimeError):
    """The server could not be found, prepared, started, or did not become ready."""


def report(error: Exception | str) -> int:
    """`error` as the one line "error: ..." on stderr; the exit code 1 of a command that failed."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    return 1


def log_tail(path: Path | str | None, lines: int = 40) -> str:
    """The last `lines` meaningful lines of a server log (Triton's start-up option tables left out)."""
    if path is None:
        return "(no log)"
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    kept = [line for line in text.splitlines() if line.strip() and not line.startswith(("|", "+-"))]
    return "\n".join(kept[-lines:]) if kept else "(log is empty)"


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    pids = []
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        with contextlib.suppress(OSError):  # exited meanwhile
            if os.getpgid(pid) == pgid:
                pids.append(pid)
    return pids


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True

