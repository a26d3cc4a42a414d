"""Which server a Triton benchmark measures: a running one (`--url`), else its own, exported and rendered
into its build folder and started by the server package's `running_server`."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from mimi_code2wav.client.protocol import ClientError
from mimi_code2wav.export.render import add_serving_arguments, serving_from_args
from mimi_code2wav.server.serve import LOCAL_TARGETS

from .profile import PointProfile
from .provenance import REPO_ROOT, log, run_meta


class LocalServer:
    """A rendered repository and, while `running()`, the tritonserver serving it (`server`, else None)."""

    def __init__(self, repository: Path, log_path: Path, description: str):
        self.repository, self.log_path, self.description = repository, log_path, description
        onnx_path = repository / "mimi_decoder" / "1" / "model.onnx"
        self.onnx_path = onnx_path if onnx_path.is_file() else None
        self.server = None

    @classmethod
    def prepare(cls, args: argparse.Namespace) -> LocalServer:
        """Export (when stale) and render the repository `args` ask for; the server is not started."""
        try:
            from mimi_code2wav.export.pipeline import prepare_local_repository
        except ImportError as exc:
            raise ClientError(f"starting a local server needs the serve and export extras ({exc}); or pass --url") from None
        serving = serving_from_args(args, args.decoder)
        serving.instance_kind = args.instance_kind or "KIND_CPU"  # a local decoder runs on the CPU, whatever its target
        repository = prepare_local_repository(args.weights, args.weights is None, 0, Path(args.build_dir),
                                              target=args.decoder, serving=serving)
        log_path = Path(args.build_dir) / "tritonserver.log"
        shown = log_path.resolve().relative_to(REPO_ROOT) if log_path.resolve().is_relative_to(REPO_ROOT) else log_path
        return cls(repository, log_path, f"local tritonserver 2.51 (pytriton wheel), {args.decoder} decoder, "
                   f"{args.front_instances} code2wav instance(s), batcher waits {args.front_queue_delay_us} us "
                   f"(code2wav) / {args.max_queue_delay_us} us (decoder), log {shown}")

    @contextlib.contextmanager
    def running(self) -> Iterator[LocalServer]:
        """The server started on free loopback ports for the block, stopped after it."""
        from mimi_code2wav.server.supervise import running_server

        with running_server(self.repository, log_path=self.log_path, ready_timeout_s=120.0) as server:
            self.server = server
            try:
                yield self
            finally:
                self.server = None

    @property
    def url(self) -> str:
        return self.server.grpc_url


def add_server_arguments(parser: argparse.ArgumentParser, url: bool = True, build_dir: str = "bench") -> None:
    """A running server (`--url`, or $URL as perf.sh reads it), else a local one of its own (`--decoder`,
    `--weights`, `--build-dir` and the serving flags of render)."""
    if url:
        parser.add_argument("--url", default=os.environ.get("URL") or None,
                            help="Triton gRPC address of a running server (default: $URL, else start a local one)")
    parser.add_argument("--decoder", choices=LOCAL_TARGETS, default="python-ort",
                        help="the local server's decoder: python-ort, onnxruntime (Triton's native backend, from "
                        "$ORT_BACKEND) or null, the front's own ceiling (default %(default)s)")
    parser.add_argument("--weights", help="weights for the local server (default: seeded random weights)")
    parser.add_argument("--build-dir", type=Path, default=REPO_ROOT / "build" / build_dir,
                        help="export folder of the local server")
    add_serving_arguments(parser)


@contextlib.contextmanager
def measured_server(args: argparse.Namespace) -> Iterator[LocalServer | None]:
    """The local server `add_server_arguments` asks for, running for the block; None with `--url`."""
    if args.url:
        yield None
        return
    log("starting a local server ...")
    with LocalServer.prepare(args).running() as local:
        yield local


def server_meta(benchmark: str, args: argparse.Namespace, local: LocalServer | None, **fields) -> dict:
    """The stamp of a run on `local`, else on the running server at `--url`: kind BENCHMARK-DECODER or
    BENCHMARK-url, the server described."""
    return run_meta(f"{benchmark}-{args.decoder}" if local else f"{benchmark}-url", decoder=args.decoder if local else None,
                    server=local.description if local else f"running server at {args.url}", **fields)


def point_profile(local: LocalServer | None, models: tuple[str, ...] = PointProfile.MODELS) -> PointProfile:
    """The profile of a point on `local` (`models`: the front first); of the load generator alone for a running server."""
    return PointProfile(local.server.pid, local.server.metrics_url, models) if local else PointProfile(None, None)
