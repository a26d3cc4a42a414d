"""A server process's log tail, process group, stop and parent-death signal."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence


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
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
    return pids


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def stop_process_group(process: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM `process` (leading its own process group), SIGKILL the group after `grace_s`, then wait
    for the rest of the group (Python stubs) to go, killing it after 5 s. Idempotent; the leader's code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # not yet reaped: a zombie at worst
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    # The rest of the group notices its leader is gone and exits; give it a moment, then make sure.
    for kill_first in (False, True):
        if kill_first and process_group_alive(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while process_group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return process.returncode


def with_parent_death_signal(command: Sequence[str]) -> tuple[list[str], Callable[[], None] | None]:
    """`command` (and a preexec_fn) such that Linux SIGTERMs the child when this process dies
    (PR_SET_PDEATHSIG), so a launcher killed without stop() takes its server along."""
    # setpriv execs the command with no Python code in the forked child; a preexec_fn runs Python's
    # at-fork hooks there, which in a process with threads can crash it before exec (seen: a SIGSEGV).
    setpriv = shutil.which("setpriv", path=f"{os.environ.get('PATH', '')}{os.pathsep}/usr/bin{os.pathsep}/bin")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "TERM", "--", *command], None
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc
        return list(command), None
    pr_set_pdeathsig = 1
    return list(command), lambda: prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
