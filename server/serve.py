"""`code2wav-server serve`: run the local tritonserver in the foreground until Ctrl-C or SIGTERM.

Without --model-repository the repository is prepared first (`export.pipeline.prepare_local_repository`:
exported when missing or stale, rendered with the python-ort decoder under the build folder). Ctrl-C or
SIGTERM stops the server and its Python stubs, removes their shared memory and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from .triton import LOCALHOST, ServerError, TritonServer, log_tail


class _StopRequested(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""


def prepare_repository(args: argparse.Namespace) -> Path:
    """The model repository to serve: `--model-repository` as it is, else the local python-ort
    repository under build/, exported first when missing or stale for the weights (`--weights`,
    `--random-init`, else kyutai/mimi when available, else seeded random weights)."""
    if args.model_repository is not None:
        repository = Path(args.model_repository)
        if not repository.is_dir():
            raise ServerError(f"model repository {repository} is not a directory")
        return repository
    from mimi_code2wav.export.pipeline import prepare_local_repository
    from mimi_code2wav.export.weights import WeightsError

    try:
        return prepare_local_repository(args.weights, args.random_init, args.seed, Path(args.build_dir))
    except WeightsError as error:
        raise ServerError(str(error)) from error


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


def run(args: argparse.Namespace) -> int:
    stop_signals = _StopSignals()
    server = None
    try:
        stop_signals.arm()
        repository = prepare_repository(args)
        server = TritonServer(
            repository,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            host=args.host,
            log_path=args.log_file,
            log_verbose=args.log_verbose,
        )
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
            "Ctrl-C or SIGTERM stops it.",
            flush=True,
        )
        code = server.wait()
        print(
            f"tritonserver exited by itself with code {code}:\n{log_tail(server.log_path)}",
            file=sys.stderr,
            flush=True,
        )
        return code or 1
    except _StopRequested as stop:
        print(f"{stop}: stopping tritonserver", flush=True)
        code = 0
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_quietly(stop_signals, server.stop if server is not None else None, "tritonserver")
    return code


def add_repository_arguments(parser: argparse.ArgumentParser, served_by: str = "to serve") -> None:
    """What `prepare_repository` reads: a repository as it is, or the weights to export one from."""
    parser.add_argument("--model-repository", type=Path, help=f"model repository {served_by}")
    parser.add_argument("--weights", help="Mimi weights: transformers folder, moshi .safetensors file or hub id "
                        "(default: kyutai/mimi when available, else seeded random weights)")
    parser.add_argument("--random-init", action="store_true", help="serve seeded random weights (noise)")
    parser.add_argument("--seed", type=int, default=None, help="seed for --random-init")
    parser.add_argument("--build-dir", default="build", help="where exports and the rendered repository go")


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
