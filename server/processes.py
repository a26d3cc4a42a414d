"""What the launcher of a server process needs: its log's tail, readiness, its process group and its
stop, and the parent-death signal (`triton.TritonServer` uses them)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

# Log lines that make a tail useful: the option tables Triton prints at start-up are not.
_TABLE_LINE_PREFIXES = ("|", "+-")


class ServerError(RuntimeError):
    """The server could not be found, prepared, started, or did not become ready."""


def log_tail(path: Path | str | None, lines: int = 40) -> str:
    """The last `lines` meaningful lines of a server log (start-up option tables left out)."""
    if path is None:
        return "(no log)"
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    kept = [line for line in text.splitlines() if line.strip() and not line.startswith(_TABLE_LINE_PREFIXES)]
    return "\n".join(kept[-lines:]) if kept else "(log is empty)"


def http_ready(url: str, timeout_s: float) -> str | None:
    """None when GET `url` answers 200, else what it answered ("HTTP 503", the connection error)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}"
    except (urllib.error.URLError, ConnectionError, OSError) as error:
        return str(error)


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
        return True
    return True


def stop_process_group(process: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM `process` (the leader of its own process group), SIGKILL the group if it has not exited
    after `grace_s`, then wait until the rest of the group (Python stubs) is gone too, killing it after
    5 s. Idempotent; returns the leader's exit code."""
    def kill_group() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def wait_group(timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while process_group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            kill_group()
            process.wait()
    # The rest of the group notices its leader is gone and exits; give it a moment, then make sure.
    wait_group(5.0)
    if process_group_alive(process.pid):
        kill_group()
        wait_group(5.0)
    return process.returncode


def with_parent_death_signal(command: Sequence[str]) -> tuple[list[str], Callable[[], None] | None]:
    """`command` (and a preexec_fn) such that Linux SIGTERMs the child when this process dies
    (PR_SET_PDEATHSIG), so a launcher killed without stop() takes its server along.

    `setpriv --pdeathsig TERM --` execs the command with no Python code in the forked child: a
    preexec_fn runs Python's at-fork hooks there, which in a process with threads can crash it before
    exec (seen: a SIGSEGV, the server dying at once with an empty log). It is only the fallback."""
    setpriv = shutil.which("setpriv") or next((path for path in ("/usr/bin/setpriv", "/bin/setpriv")
                                                if os.access(path, os.X_OK)), None)
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "TERM", "--", *command], None
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc
        return list(command), None
    set_pdeathsig, sigterm = 1, int(signal.SIGTERM)
    return list(command), lambda: prctl(set_pdeathsig, sigterm, 0, 0, 0)
