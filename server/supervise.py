"""The one restart policy (docs/design.md §5.2): serve's `Supervisor`; `running_server` for tests and benchmarks."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from .processes import ServerError, log_tail
from .triton import TritonServer

# A server that lived STABLE_AFTER_S restarts after FIRST_RESTART_DELAY_S; one that dies sooner waits twice
# its last delay, up to MAX_RESTART_DELAY_S: one that cannot stay up is retried once a minute, not in a loop.
STABLE_AFTER_S = 60.0
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 60.0


class StopRequested(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""


def describe_exit(code: int | None) -> str:
    """'exited with code 1', 'was killed by SIGKILL' (a negative Popen code, or 128 + the signal from a shell)."""
    if code is None or 0 <= code <= 128:
        return f"exited with code {code}"
    signum = -code if code < 0 else code - 128
    return f"was killed by {next((s.name for s in signal.Signals if s == signum), f'signal {signum}')}"


def restart_delay_s(previous_s: float, lived_s: float) -> float:
    """The delay before restarting a server that died after `lived_s` s up (`previous_s`: the last delay, or 0)."""
    crashed_again = previous_s > 0 and lived_s < STABLE_AFTER_S
    return min(2 * previous_s, MAX_RESTART_DELAY_S) if crashed_again else FIRST_RESTART_DELAY_S


class Supervisor:
    """A foreground command's signals and the server it keeps up. The first SIGINT or SIGTERM raises StopRequested
    once, deferred while tritonserver is being created so that the stop ends all it started; SIGHUPs are counted."""

    def __init__(self, restart: bool, ready_timeout_s: float):
        self.restart, self.ready_timeout_s = restart, ready_timeout_s
        self.server: TritonServer | None = None
        self.armed = self.stopping = False
        self.received: list[str] = []
        self.hangups = self.restarts = 0
        self.delay_s = 0.0  # the last restart delay
        signal.signal(signal.SIGTERM, self._stop_signal)
        signal.signal(signal.SIGINT, self._stop_signal)
        signal.signal(signal.SIGHUP, lambda *_: setattr(self, "hangups", self.hangups + 1))  # nothing to deadlock on

    def _stop_signal(self, signum, frame) -> None:
        self.received.append(signal.Signals(signum).name)
        if self.armed:
            self.arm()

    def arm(self) -> None:
        """From now on (and at once, for one recorded before) a stop signal raises StopRequested, once."""
        self.armed = True
        if self.received and not self.stopping:
            self.stopping, self.armed = True, False
            raise StopRequested(self.received[0])

    def run(self, command: Callable[[], int]) -> int:
        """`command`'s exit code, or 0 once SIGINT/SIGTERM drained tritonserver; later signals are ignored."""
        try:
            self.arm()
            return command()
        except StopRequested as stop:
            print(f"{stop}: draining and stopping tritonserver", flush=True)
            return 0
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN)
            if self.server is not None:
                began = time.monotonic()
                self.server.stop()
                if self.stopping:
                    print(f"tritonserver stopped in {time.monotonic() - began:.1f} s", flush=True)

    def launch(self, server: TritonServer) -> None:
        self.armed, self.server = False, server
        try:
            server.start()
        finally:
            self.arm()

    def supervise(self, poll_s: float = 0.5) -> int:
        """Restarts a server that died (after the backoff, its log kept as <log>.<n>) and, at once, one that
        SIGHUP drained; without `restart`, the exit code of one that died (a stop signal raises out of here)."""
        hangups_seen, restart_at = 0, None
        while True:
            time.sleep(poll_s)
            server = self.server
            if self.hangups != hangups_seen:
                hangups_seen, restart_at = self.hangups, time.monotonic()
                print(f"SIGHUP: draining tritonserver (pid {server.tritonserver_pid()}) to start it again", flush=True)
                server.stop()  # SIGTERM, which the entrypoint passes on to tritonserver
                print(f"tritonserver (pid {server.tritonserver_pid()}) drained ({describe_exit(server.exit_code())})",
                      flush=True)
            elif server.is_alive():
                continue
            elif restart_at is None:
                lived_s = time.monotonic() - server.started_at
                self.delay_s = restart_delay_s(self.delay_s, lived_s) if self.restart else 0.0
                restart_at = time.monotonic() + self.delay_s
                delay = f"; restart in {self.delay_s:.1f} s on the same ports" if self.restart else ""
                print(f"tritonserver (pid {server.tritonserver_pid()}) {describe_exit(server.exit_code())} after "
                      f"{lived_s:.0f} s{delay}. Log tail ({server.log_path}):\n{log_tail(server.log_path, lines=15)}",
                      file=sys.stderr, flush=True)
                if not self.restart:
                    return server.exit_code() or 1
            if time.monotonic() < restart_at:
                continue
            server.stop()  # its stubs and shared memory gone
            self.restarts, restart_at = self.restarts + 1, None
            if server.log_path.exists():
                server.log_path.rename(server.log_path.with_name(f"{server.log_path.name}.{self.restarts}"))
            self.launch(dataclasses.replace(server))
            try:
                ready_s = self.server.wait_ready(self.ready_timeout_s)
                print(f"tritonserver restarted (pid {self.server.tritonserver_pid()}, restart {self.restarts}), "
                      f"ready in {ready_s:.1f} s on {self.server.grpc_url}", flush=True)
            except ServerError as error:  # then handled as a server that died
                self.server.stop()  # one still loading would otherwise look alive
                print(f"error: tritonserver did not come back: {error}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def running_server(model_repository: Path | str, *, ready_timeout_s: float = 60.0, attempts: int = 3,
                   **kwargs) -> Iterator[TritonServer]:
    """A ready TritonServer(**kwargs), stopped on exit; started again up to `attempts` times when a picked port was
    taken meanwhile or tritonserver 2.51 aborted initialising its backends (docs/design.md §7)."""
    ports_fixed = any(kwargs.get(name) for name in ("http_port", "grpc_port", "metrics_port"))
    for attempt in range(1, attempts + 1):
        server = TritonServer(model_repository, **kwargs)
        try:
            server.start()
            server.wait_ready(ready_timeout_s)
            break
        except BaseException as error:
            server.stop()
            crashed = describe_exit(server.exit_code()).startswith("was killed")
            if not isinstance(error, ServerError) or attempt == attempts or not (
                    crashed or not ports_fixed and server.port_taken()):
                raise
            print(f"tritonserver did not start (attempt {attempt} of {attempts}), starting it again: "
                  f"{str(error).splitlines()[0]}", file=sys.stderr, flush=True)
    try:
        yield server
    finally:
        server.stop()
