"""Run the local tritonserver in the foreground, supervised (docs/design.md §5.2); Ctrl-C stops it.

Without --model-repository the repository for --decoder is exported (when missing or stale for the weights) and
rendered under the build folder. tritonserver runs under the entrypoint script, with TLS and keys from the options
below: it kills a hung server or one whose Python stub died. A server that exits is started again on the same ports
after a delay that doubles while it keeps dying soon after its start; --no-restart exits with it. SIGHUP drains it
and starts it again at once, reading the repository afresh. Ctrl-C or SIGTERM drains and stops it within its exit
timeout (25 s), then exits 0."""

from __future__ import annotations

import argparse
from pathlib import Path

from .processes import ServerError
from .security import add_security_arguments, write_access_folder
from .supervise import Supervisor
from .triton import LOCALHOST, TritonServer

# The decoder targets a local server renders (tensorrt needs a plan built on a GPU).
LOCAL_TARGETS = ("python-ort", "onnxruntime", "null")


def run(args: argparse.Namespace) -> int:
    supervisor = Supervisor(args.restart, args.ready_timeout)
    return supervisor.run(lambda: _serve(args, supervisor))


def _serve(args: argparse.Namespace, supervisor: Supervisor) -> int:
    access_dir = write_access_folder(Path(args.build_dir) / f"access-{args.grpc_port}", args)
    repository = args.model_repository
    if repository is None:
        from mimi_code2wav.export.pipeline import prepare_local_repository
        from mimi_code2wav.export.weights import WeightsError

        try:
            repository = prepare_local_repository(args.weights, args.random_init, args.seed, Path(args.build_dir),
                                                  target=args.decoder)
        except WeightsError as error:
            raise ServerError(str(error)) from error
    server = TritonServer(repository, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, host=args.host, log_path=args.log_file,
                          log_verbose=args.log_verbose, access_dir=access_dir, watch=True)
    supervisor.launch(server)
    print(f"tritonserver starting, log: {server.log_path}", flush=True)
    ready_after_s = server.wait_ready(args.ready_timeout)
    marker = "triton-watchdog: access: "  # what the entrypoint script said of TLS and the keys
    access = [line for line in server.log_path.read_text(errors="replace").splitlines() if line.startswith(marker)]
    print(f"tritonserver ready in {ready_after_s:.1f} s (pid {server.tritonserver_pid()}), serving {repository}\n"
          f"  gRPC     {server.grpc_url}\n"
          f"  HTTP     http://{server.http_url}\n"
          f"  metrics  {server.metrics_url}\n"
          f"  access   {access[-1][len(marker):] if access else 'unknown (see the server log)'}\n"
          f"A server that dies is {'restarted' if args.restart else 'not restarted (--no-restart)'}. "
          "SIGHUP drains and restarts it; Ctrl-C or SIGTERM drains and stops it.", flush=True)
    return supervisor.supervise()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-repository", type=Path, help="model repository to serve")
    parser.add_argument("--weights", help="Mimi weights: transformers folder, moshi .safetensors file or hub id "
                        "(default: kyutai/mimi when available, else seeded random weights)")
    parser.add_argument("--random-init", action="store_true", help="serve seeded random weights (noise)")
    parser.add_argument("--seed", type=int, default=None, help="seed for --random-init")
    parser.add_argument("--build-dir", default="build", help="where exports and the rendered repository go")
    parser.add_argument("--decoder", choices=LOCAL_TARGETS, default="python-ort",
                        help="the decoder target to render: python-ort (any machine), onnxruntime (Triton's native "
                        "backend, from $ORT_BACKEND), null (silence: the front's ceiling) (default %(default)s)")
    parser.add_argument("--host", default=LOCALHOST, help="address to bind (default %(default)s)")
    for name, port in (("http", 8000), ("grpc", 8001), ("metrics", 8002)):
        parser.add_argument(f"--{name}-port", type=int, default=port)
    parser.add_argument("--log-file", type=Path, default=Path("build") / "tritonserver.log",
                        help="server log (default %(default)s)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbose log level")
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for readiness")
    parser.add_argument("--no-restart", dest="restart", action="store_false",
                        help="exit when tritonserver dies instead of starting it again")
    add_security_arguments(parser)
