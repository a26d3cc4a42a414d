"""`code2wav-server serve`: run the local tritonserver in the foreground until Ctrl-C or SIGTERM.

Without --model-repository the repository is prepared first (`export.pipeline.prepare_local_repository`:
exported when missing or stale, rendered with the `--decoder` target, python-ort by default, under the build folder).

tritonserver runs under the entrypoint script that compose and Kubernetes run (security.ENTRYPOINT),
with TLS and keys from an access folder that serve writes from its options (<build-dir>/access-<gRPC
port>): the script kills a hung server or one whose Python stub died. Supervised (`supervise`): a
server that exits (a crash, the OOM killer, the script's kill) is started again on the same ports
after a short delay that doubles while it keeps dying soon after its start; its streams are lost there
and resumable clients resume them (docs/design.md §2.4). `--no-restart` exits with the server instead.
SIGHUP drains the server and starts it again at once on the same ports, reading the repository afresh
(new weights, a new config).

Ctrl-C or SIGTERM drains and stops the server: tritonserver refuses new streams at once, answers the
live streams' requests with UNAVAILABLE (resumable clients move on), lets the abandoned streams idle
out and unloads both models within its exit timeout (DEFAULT_EXIT_TIMEOUT_S, inside Kubernetes' 30 s
grace period); then its Python stubs and shared memory are gone and the command exits 0
(docs/design.md §5.2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .processes import ServerError
from .security import add_security_arguments, write_access_folder
from .supervise import Foreground, Supervised, run_in_foreground, supervise
from .triton import LOCALHOST, TritonServer

# The decoder targets a local server renders (tensorrt needs a plan built on a GPU).
LOCAL_TARGETS = ("python-ort", "onnxruntime", "null")


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


def _new_server(args: argparse.Namespace, repository: Path, access_dir: Path,
                ports: tuple | None = None) -> TritonServer:
    http_port, grpc_port, metrics_port = ports or (args.http_port, args.grpc_port, args.metrics_port)
    return TritonServer(repository, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                        host=args.host, log_path=args.log_file, log_verbose=args.log_verbose, access_dir=access_dir,
                        watch=True)


def _access_line(server: TritonServer) -> str:
    """What the entrypoint script said of TLS and the keys (its `access:` line in the server's log)."""
    marker = "triton-watchdog: access: "
    lines = [line for line in server.log_path.read_text(errors="replace").splitlines() if line.startswith(marker)]
    return lines[-1][len(marker):] if lines else "unknown (see the server log)"


def run(args: argparse.Namespace) -> int:
    return run_in_foreground(lambda foreground: _serve(args, foreground), "draining and stopping tritonserver",
                             "tritonserver")


def _serve(args: argparse.Namespace, foreground: Foreground) -> int:
    """Start the server, then supervise it: restarted whenever it dies (or its exit code with --no-restart)."""
    access_dir = write_access_folder(Path(args.build_dir) / f"access-{args.grpc_port}", args)
    repository = prepare_repository(args)
    server = Supervised(_new_server(args, repository, access_dir),
                        lambda ports: _new_server(args, repository, access_dir, ports), "tritonserver")
    foreground.stop = lambda: server.server.stop()
    server.launch(foreground.launch_guard)
    print(f"tritonserver starting, log: {server.log_path}", flush=True)
    ready_after_s = server.server.wait_ready(args.ready_timeout)
    print(f"tritonserver ready in {ready_after_s:.1f} s (pid {server.pid}), serving {repository}\n"
          f"  gRPC     {server.grpc_url}\n"
          f"  HTTP     http://{server.http_url}\n"
          f"  metrics  {server.metrics_url}\n"
          f"  access   {_access_line(server.server)}\n"
          f"A server that dies is {'restarted' if args.restart else 'not restarted (--no-restart)'}. "
          "SIGHUP drains and restarts it; Ctrl-C or SIGTERM drains and stops it.", flush=True)
    return supervise(server, foreground, restart=args.restart, ready_timeout_s=args.ready_timeout)


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
    parser.add_argument("--log-file", type=Path, default=Path("build") / "tritonserver.log",
                        help="server log (default %(default)s)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbose log level")
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for readiness")
    parser.add_argument("--no-restart", dest="restart", action="store_false",
                        help="exit when tritonserver dies instead of starting it again")
    add_security_arguments(parser)
