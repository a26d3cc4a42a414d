"""The project's one restart policy (docs/design.md §5.2): `code2wav-server serve`'s supervisor, and
`running_server`, the library call that the tests and benchmarks start servers with.

`run_in_foreground`: the first SIGINT or SIGTERM stops the command once and cleanly (a second signal
cannot interrupt that stop), and one that lands while a process is being created waits until it exists
(`Foreground.launch_guard`), so the stop knows every process it has to end. `supervise` then polls the
server, which runs under the entrypoint script (security.ENTRYPOINT: it kills a hung server or one
whose Python stub died): one that exits is reported and, with restarts, started again on the same
ports after `RestartBackoff`'s delay (its log kept as <log>.<n>); SIGHUP drains it and starts it again
at once, reading the repository afresh. Container engines restart their own containers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager, Iterator

from .processes import ServerError, log_tail
from .triton import TritonServer

# A server that lived at least this long before dying is restarted after FIRST_RESTART_DELAY_S; one
# that dies sooner than that after its previous restart waits twice as long as last time, up to
# MAX_RESTART_DELAY_S: a server that cannot stay up is retried about once a minute, not in a loop.
STABLE_AFTER_S = 60.0
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 60.0


class StopRequested(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""


class StopSignals:
    """SIGINT/SIGTERM handler. Disarmed (a process being created), a signal is only recorded; armed, the
    first one raises StopRequested in the main thread, once. SIGHUP is counted in `hangups` from the
    start, so that one arriving while the server starts neither kills the command nor is lost."""

    def __init__(self):
        self.armed = False
        self.stopping = False
        self.received: list[str] = []
        self.hangups = 0
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGHUP, self._hangup)

    def _hangup(self, signum, frame) -> None:
        self.hangups += 1  # a plain counter: nothing a signal handler can deadlock on

    def __call__(self, signum, frame):
        self.received.append(signal.Signals(signum).name)
        if self.armed:
            self._stop()

    def disarm(self) -> None:
        self.armed = False

    def arm(self) -> None:
        self.armed = True
        if self.received:
            self._stop()

    def _stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.armed = False
            raise StopRequested(self.received[0])


@dataclasses.dataclass
class Foreground:
    """A foreground command's stop: `signals` request it, `stop` ends what the command started (the
    command sets it as soon as it has created that; None before)."""

    signals: StopSignals
    stop: Callable[[], object] | None = None

    @contextlib.contextmanager
    def launch_guard(self) -> Iterator[None]:
        """Record, without acting on, SIGINT/SIGTERM while a process is being created; act on exit."""
        self.signals.disarm()
        try:
            yield
        finally:
            self.signals.arm()


def run_in_foreground(command: Callable[[Foreground], int], stopping: str, what: str) -> int:
    """Run `command` to its exit code, or until SIGINT/SIGTERM stops it ("<signal>: <stopping>", exit 0);
    a ServerError is one line "error: ..." and exit 1. Either way `foreground.stop` runs at the end with
    later signals ignored (its grace periods bound it), then after a stop signal "<what> stopped in N s"."""
    foreground = Foreground(StopSignals())
    try:
        foreground.signals.arm()
        return command(foreground)
    except StopRequested as stop:
        print(f"{stop}: {stopping}", flush=True)
        return 0
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        if foreground.stop is not None:
            began = time.monotonic()
            foreground.stop()
            if foreground.signals.stopping:
                print(f"{what} stopped in {time.monotonic() - began:.1f} s", flush=True)


class RestartBackoff:
    """When to start a server again after it died (the constants above)."""

    def __init__(self, first_s: float = FIRST_RESTART_DELAY_S, max_s: float = MAX_RESTART_DELAY_S,
                 stable_after_s: float = STABLE_AFTER_S):
        self.first_s, self.max_s, self.stable_after_s = first_s, max_s, stable_after_s
        self.restarts, self.delay_s = 0, 0.0

    def after_exit(self, lived_s: float) -> float:
        """A server died after `lived_s` seconds up: the delay before its restart (counted)."""
        crashed_again = self.restarts > 0 and lived_s < self.stable_after_s
        self.delay_s = min(max(2 * self.delay_s, self.first_s), self.max_s) if crashed_again else self.first_s
        self.restarts += 1
        return self.delay_s


def describe_exit(code: int | None) -> str:
    """'exited with code 1', 'was killed by SIGKILL' (a negative Popen return code, or 128 + the signal
    from the entrypoint's shell)."""
    signum = None if code is None or 0 <= code <= 128 else -code if code < 0 else code - 128
    if signum is not None:
        try:
            return f"was killed by {signal.Signals(signum).name}"
        except ValueError:
            return f"was killed by signal {signum}"
    return f"exited with code {code}"


@dataclasses.dataclass
class Supervised:
    """The supervised tritonserver. `new_server(ports)` makes its successor on the same (HTTP, gRPC,
    metrics) ports; `server` is replaced on every restart. `label` names it in messages."""

    server: TritonServer
    new_server: Callable[[tuple], TritonServer]
    label: str
    restarts: int = 0
    exit_reported: bool = False
    started_at: float = 0.0
    backoff: RestartBackoff = dataclasses.field(default_factory=RestartBackoff)
    next_restart_at: float = 0.0

    # Read from the current server, which each restart replaces.
    pid = property(lambda self: self.server.tritonserver_pid())
    grpc_url = property(lambda self: self.server.grpc_url)
    http_url = property(lambda self: self.server.http_url)
    metrics_url = property(lambda self: self.server.metrics_url)
    log_path = property(lambda self: self.server.log_path)

    def is_alive(self) -> bool:
        return self.server.is_alive()

    def exit_code(self) -> int | None:
        return self.server.exit_code()

    def launch(self, guard: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        with guard():
            self.started_at = time.monotonic()
            self.server.start()

    def kill(self, signum: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send `signum` to the server's entrypoint (it passes SIGTERM on to tritonserver); returns its
        exit code once it exited (`relaunch` and `stop` clean up what is left of its group)."""
        if not self.is_alive():
            raise ServerError(f"{self.label} is not running")
        self.server.process.send_signal(signum)
        return self.server.process.wait(timeout_s)

    def relaunch(self, ready_timeout_s: float, guard: Callable[[], ContextManager] = contextlib.nullcontext) -> float:
        """Start the server again on the same ports and wait until it is ready; returns the seconds
        that took. A running server is stopped first; the previous log is kept as <log>.<n>."""
        old = self.server
        old.stop()  # a dead one: waits for its stubs, removes its shared memory
        self.restarts += 1
        if old.log_path is not None and old.log_path.exists():
            old.log_path.rename(old.log_path.with_name(f"{old.log_path.name}.{self.restarts}"))
        self.server = self.new_server((old.http_port, old.grpc_port, old.metrics_port))
        self.exit_reported = False
        self.launch(guard)
        try:
            return self.server.wait_ready(ready_timeout_s)
        except ServerError as error:
            self.server.stop()  # one still loading would otherwise look alive
            raise ServerError(f"{self.label} did not come back: {error}") from error


def supervise(server: Supervised, foreground: Foreground, *, restart: bool, ready_timeout_s: float,
              poll_s: float = 0.5) -> int:
    """Watch `server` until the command ends (module docstring); returns the exit code. A stop signal is
    raised out of here; SIGHUPs are `foreground.signals.hangups`."""
    signals, guard = foreground.signals, foreground.launch_guard
    hangups_seen = 0
    while True:
        time.sleep(poll_s)
        if signals.hangups != hangups_seen:
            hangups_seen = signals.hangups
            print(f"SIGHUP: draining tritonserver (pid {server.pid}) to start it again", flush=True)
            _drain_and_restart(server, ready_timeout_s, guard)
            continue
        if not server.is_alive():
            _dead(server, restart, ready_timeout_s, guard)
            if not restart:
                return server.exit_code() or 1


def _dead(server: Supervised, restart: bool, ready_timeout_s: float, guard) -> None:
    now = time.monotonic()
    if not server.exit_reported:
        server.exit_reported = True
        lived_s = now - server.started_at
        delay = f"; restart in {server.backoff.after_exit(lived_s):.1f} s on the same ports" if restart else ""
        print(f"{server.label} (pid {server.pid}) {describe_exit(server.exit_code())} after {lived_s:.0f} s"
              f"{delay}. Log tail ({server.log_path}):\n{log_tail(server.log_path, lines=15)}",
              file=sys.stderr, flush=True)
        server.next_restart_at = now + server.backoff.delay_s
    if restart and now >= server.next_restart_at and (ready_s := _relaunch(server, ready_timeout_s, guard)) is not None:
        print(f"{server.label} restarted (pid {server.pid}, restart {server.restarts}), ready in {ready_s:.1f} s "
              f"on {server.grpc_url}", flush=True)


def _relaunch(server: Supervised, ready_timeout_s: float, guard) -> float | None:
    """`server.relaunch()`; None when it failed (said, and the server is then handled as one that died)."""
    try:
        return server.relaunch(ready_timeout_s, guard)
    except ServerError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        server.exit_reported = False  # report, and schedule the next attempt
        return None


def _drain_and_restart(server: Supervised, ready_timeout_s: float, guard) -> None:
    """Drained (SIGTERM: its streams resume), started again on the same ports. When it does not come
    back it is reported and restarted (or not) as a server that died."""
    began, pid = time.monotonic(), server.pid
    if server.is_alive():
        with contextlib.suppress(subprocess.TimeoutExpired):  # relaunch stops what is left of it
            server.kill(signal.SIGTERM, timeout_s=server.server.stop_grace_s)
    drained = describe_exit(server.exit_code())
    if (ready_s := _relaunch(server, ready_timeout_s, guard)) is None:
        return
    print(f"{server.label} (pid {pid}) drained ({drained}) and restarted in {time.monotonic() - began:.1f} s "
          f"(ready in {ready_s:.1f} s, pid {server.pid}, restart {server.restarts})", flush=True)


def _port_taken(server: TritonServer) -> bool:
    tail = log_tail(server.log_path, lines=200)
    return "already in use" in tail or "Address in use" in tail


@contextlib.contextmanager
def running_server(model_repository: Path | str, *, ready_timeout_s: float = 60.0, attempts: int = 3,
                   **kwargs) -> Iterator[TritonServer]:
    """Start a TritonServer (keyword arguments go to it) on free loopback ports, wait until it is ready,
    yield it, stop it.

    A port picked free can be taken before the server binds it, and tritonserver 2.51 now and then aborts
    while its backends initialise (docs/design.md §7): then it retries (new ports where they were picked),
    up to `attempts` times, saying so on stderr. Any other failure raises ServerError with the log tail.
    """
    ports_fixed = any(kwargs.get(name) is not None for name in ("http_port", "grpc_port", "metrics_port"))
    for attempt in range(1, attempts + 1):
        server = TritonServer(model_repository, **kwargs)
        server.start()
        try:
            server.wait_ready(ready_timeout_s)
        except ServerError as error:
            server.stop()
            crashed = describe_exit(server.exit_code()).startswith("was killed")
            if attempt < attempts and (crashed or (not ports_fixed and _port_taken(server))):
                print(f"tritonserver did not start (attempt {attempt} of {attempts}), starting it again: "
                      f"{str(error).splitlines()[0]}", file=sys.stderr, flush=True)
                continue
            raise
        except BaseException:
            server.stop()
            raise
        break
    try:
        yield server
    finally:
        server.stop()
