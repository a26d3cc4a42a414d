"""`code2wav-server serve`: run the local tritonserver in the foreground until Ctrl-C or SIGTERM.

Without --model-repository the repository is prepared first (`export.pipeline.prepare_local_repository`:
exported when missing or stale, rendered with the `--decoder` target, python-ort by default, under the build folder).

A tritonserver that dies (a crash, the OOM killer) is started again on the same ports, one log line
each, after a short delay that doubles while it keeps dying soon after its start (`RestartBackoff`);
its streams are lost there and resumable clients replay them (docs/design.md §2.4). `--no-restart`
exits with the server instead.

SIGHUP drains the server the same way and starts it again at once on the same ports, reading the
repository afresh (new weights, a new config): the operator's restart; resumable clients replay their
streams on it. Ctrl-C or SIGTERM drains and stops the server: tritonserver refuses new streams at once, answers the
live streams' requests with UNAVAILABLE (resumable clients move on), lets the abandoned streams idle
out and unloads both models within its exit timeout (DEFAULT_EXIT_TIMEOUT_S, inside Kubernetes' 30 s
grace period); then its Python stubs and shared memory are gone and the command exits 0
(docs/design.md §5.2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from .triton import LOCALHOST, ServerError, TritonServer, log_tail

# The decoder targets a local server renders (tensorrt needs a plan built on a GPU).
LOCAL_TARGETS = ("python-ort", "onnxruntime", "null")

# A server that lived at least this long before dying is restarted after FIRST_RESTART_DELAY_S; one
# that dies sooner than that after its previous restart waits twice as long as last time, up to
# MAX_RESTART_DELAY_S: a server that cannot stay up is retried about once a minute, not in a loop.
STABLE_AFTER_S = 60.0
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 60.0


class _StopRequested(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""


def prepare_repository(args: argparse.Namespace) -> Path:
    """The model repository to serve: `--model-repository` as it is, else the local repository for
    `--decoder` under build/, exported first when missing or stale for the weights (`--weights`,
    `--random-init`, else kyutai/mimi when available, else seeded random weights)."""
    if args.model_repository is not None:
        repository = Path(args.model_repository)
        if not repository.is_dir():
            raise ServerError(f"model repository {repository} is not a directory")
        return repository
    from mimi_code2wav.export.pipeline import prepare_local_repository
    from mimi_code2wav.export.weights import WeightsError

    try:
        return prepare_local_repository(args.weights, args.random_init, args.seed, Path(args.build_dir),
                                        target=args.decoder)
    except WeightsError as error:
        raise ServerError(str(error)) from error


class RestartBackoff:
    """When to start a server again after it died: FIRST_RESTART_DELAY_S after a server that had been
    up for STABLE_AFTER_S, else twice the previous delay, up to MAX_RESTART_DELAY_S."""

    def __init__(self, first_s: float = FIRST_RESTART_DELAY_S, max_s: float = MAX_RESTART_DELAY_S,
                 stable_after_s: float = STABLE_AFTER_S):
        self.first_s, self.max_s, self.stable_after_s = first_s, max_s, stable_after_s
        self.restarts = 0
        self.delay_s = 0.0

    def after_exit(self, lived_s: float) -> float:
        """A server died after `lived_s` seconds up: the delay before its restart (counted)."""
        crashed_again = self.restarts > 0 and lived_s < self.stable_after_s
        self.delay_s = min(max(2 * self.delay_s, self.first_s), self.max_s) if crashed_again else self.first_s
        self.restarts += 1
        return self.delay_s


def describe_exit(code: int | None) -> str:
    """'exited with code 1', 'was killed by SIGKILL' (a negative Popen return code)."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _StopSignals:
    """SIGINT/SIGTERM handler. While disarmed (the server process being created) a signal is only
    recorded, so that stop() always knows the process it has to end; armed, the first signal
    interrupts the main thread with _StopRequested, once: every later one is only recorded, so a
    second Ctrl-C, or a process-group signal reaching the launcher twice, cannot interrupt the
    stop that the first one started."""

    def __init__(self):
        self.armed = False
        self.stopping = False
        self.received: list[str] = []
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)

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
            raise _StopRequested(self.received[0])


def stop_quietly(stop_signals: _StopSignals, stop: Callable[[], object] | None, what: str) -> None:
    """The end of a foreground command, stopped or not: later signals are ignored so they cannot
    interrupt the clean-up (`stop` is bounded by its grace periods), then `stop()`; after a requested
    stop, how long it took ("<what> stopped in N s")."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if stop is not None:
        began = time.monotonic()
        stop()
        if stop_signals.stopping:
            print(f"{what} stopped in {time.monotonic() - began:.1f} s", flush=True)


@dataclasses.dataclass
class Foreground:
    """A foreground command's stop: `signals` request it, `stop` ends what the command started (the
    command sets it as soon as it has created that; None before)."""

    signals: _StopSignals
    stop: Callable[[], object] | None = None


def run_in_foreground(command: Callable[[Foreground], int], stopping: str, what: str) -> int:
    """Run `command` to its exit code, or until SIGINT/SIGTERM stops it ("<signal>: <stopping>", exit
    0); a ServerError is one line "error: ..." and exit 1. Either way `stop` runs at the end
    (`stop_quietly`, which says "<what> stopped in N s" after a stop signal)."""
    foreground = Foreground(_StopSignals())
    try:
        foreground.signals.arm()
        return command(foreground)
    except _StopRequested as stop:
        print(f"{stop}: {stopping}", flush=True)
        return 0
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_quietly(foreground.signals, foreground.stop, what)


def _new_server(args: argparse.Namespace, repository: Path, ports: tuple | None = None) -> TritonServer:
    http_port, grpc_port, metrics_port = ports or (args.http_port, args.grpc_port, args.metrics_port)
    return TritonServer(repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                        host=args.host, log_path=args.log_file, log_verbose=args.log_verbose)


def keep_log(server: TritonServer, restarts: int) -> None:
    """A dead server's log stays as <log>.<n> beside its successor's."""
    if server.log_path is not None and server.log_path.exists():
        server.log_path.rename(server.log_path.with_name(f"{server.log_path.name}.{restarts}"))


def run(args: argparse.Namespace) -> int:
    return run_in_foreground(lambda foreground: _serve(args, foreground), "draining and stopping tritonserver",
                             "tritonserver")


def _serve(args: argparse.Namespace, foreground: Foreground) -> int:
    """Start the server, then restart it whenever it dies (or return its exit code with --no-restart)."""
    stop_signals = foreground.signals
    drain = _DrainRequests()
    repository = prepare_repository(args)
    server = _new_server(args, repository)
    foreground.stop = server.stop
    stop_signals.disarm()
    server.start()
    stop_signals.arm()
    print(f"tritonserver starting (pid {server.pid}), log: {server.log_path}", flush=True)
    ready_after_s = server.wait_ready(args.ready_timeout)
    print(
        f"tritonserver ready in {ready_after_s:.1f} s, serving {repository}\n"
        f"  gRPC     {server.grpc_url}\n"
        f"  HTTP     http://{server.http_url}\n"
        f"  metrics  {server.metrics_url}\n"
        f"A server that dies is {'restarted' if args.restart else 'not restarted (--no-restart)'}. "
        "SIGHUP drains and restarts it; Ctrl-C or SIGTERM drains and stops it.",
        flush=True,
    )
    backoff = RestartBackoff()
    restarts = 0
    while True:
        drain.serving(server)
        code = server.wait()
        lived_s = time.monotonic() - server.started_at
        restarts += 1
        if drain.exited(server):
            delay_s = 0.0
            print(f"SIGHUP: tritonserver (pid {server.pid}) drained ({describe_exit(code)}) in "
                  f"{time.monotonic() - drain.sent_at:.1f} s; restart {restarts} now on the same ports (its log: "
                  f"{server.log_path}.{restarts})", flush=True)
        elif not args.restart:
            print(f"tritonserver {describe_exit(code)} after {lived_s:.0f} s:\n{log_tail(server.log_path)}",
                  file=sys.stderr, flush=True)
            return code or 1
        else:
            delay_s = backoff.after_exit(lived_s)
            print(f"tritonserver (pid {server.pid}) {describe_exit(code)} after {lived_s:.0f} s; restart "
                  f"{restarts} in {delay_s:.1f} s on the same ports (its log: "
                  f"{server.log_path}.{restarts})", file=sys.stderr, flush=True)
        time.sleep(delay_s)
        server.stop()  # the dead one's stubs and shared memory
        keep_log(server, restarts)
        server = _new_server(args, repository, (server.http_port, server.grpc_port, server.metrics_port))
        foreground.stop = server.stop
        stop_signals.disarm()
        server.start()
        stop_signals.arm()
        try:
            ready_after_s = server.wait_ready(args.ready_timeout)
        except ServerError as error:
            print(f"error: restart {restarts} failed: {error}", file=sys.stderr, flush=True)
            server.stop()
            continue
        print(f"tritonserver back (pid {server.pid}, restart {restarts}), ready in {ready_after_s:.1f} s",
              flush=True)


class _DrainRequests:
    """SIGHUP: drain the running tritonserver (SIGTERM: it refuses new streams, live ones get
    UNAVAILABLE and resume) and start it again at once, reading the repository afresh. A SIGHUP that
    comes while a server is starting waits until it serves."""

    def __init__(self):
        self._serving: TritonServer | None = None
        self._pending = False
        self._drained: TritonServer | None = None
        self.sent_at = 0.0
        signal.signal(signal.SIGHUP, self._on_sighup)

    def serving(self, server: TritonServer) -> None:
        self._serving = server
        if self._pending:
            self._drain()

    def exited(self, server: TritonServer) -> bool:
        """`server` has exited (a SIGHUP now waits for the next one): whether a SIGHUP drained it."""
        self._serving = None
        return self._drained is server

    def _on_sighup(self, signum, frame) -> None:
        self._pending = True
        if self._serving is not None:
            self._drain()

    def _drain(self) -> None:
        server, self._pending = self._serving, False
        if server is None or server is self._drained or not server.is_alive():
            return
        # os.write, not print: a signal handler must not re-enter the buffered stdout.
        os.write(sys.stdout.fileno(), f"SIGHUP: draining tritonserver (pid {server.pid}) to start it again\n".encode())
        self._drained, self.sent_at = server, time.monotonic()
        server.process.send_signal(signal.SIGTERM)


def add_repository_arguments(parser: argparse.ArgumentParser, served_by: str = "to serve") -> None:
    """What `prepare_repository` reads: a repository as it is, or the weights to export one from."""
    parser.add_argument("--model-repository", type=Path, help=f"model repository {served_by}")
    parser.add_argument("--weights", help="Mimi weights: transformers folder, moshi .safetensors file or hub id "
                        "(default: kyutai/mimi when available, else seeded random weights)")
    parser.add_argument("--random-init", action="store_true", help="serve seeded random weights (noise)")
    parser.add_argument("--seed", type=int, default=None, help="seed for --random-init")
    parser.add_argument("--build-dir", default="build", help="where exports and the rendered repository go")
    parser.add_argument("--decoder", choices=LOCAL_TARGETS, default="python-ort",
                        help="the decoder target to render: python-ort (any machine), onnxruntime (Triton's native "
                        "backend, from $ORT_BACKEND), null (silence: the front's ceiling) (default %(default)s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_repository_arguments(parser)
    parser.add_argument("--host", default=LOCALHOST, help="address to bind (default %(default)s)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--log-file", type=Path, default=Path("build") / "tritonserver.log",
        help="server log (default %(default)s)",
    )
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbose log level")
    parser.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds to wait for readiness"
    )
    parser.add_argument("--no-restart", dest="restart", action="store_false",
                        help="exit when tritonserver dies instead of starting it again")
