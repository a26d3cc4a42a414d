"""The sweep's own local server (restarted after a crash), and the ONNX step timed alone."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mimi_code2wav.client.protocol import ClientError
from mimi_code2wav.export.serving_flags import add_serving_arguments, serving_from_args
from mimi_code2wav.server.processes import log_tail
from mimi_code2wav.server.serve import LOCAL_TARGETS

from .profile import PointProfile
from .provenance import REPO_ROOT, shown_path, timed


class LocalServer:
    """The bench's own server: a repository exported into args.build_dir, served on loopback ports.
    After a crash (tritonserver 2.51 can crash under load, docs/design.md §7) `restart()` brings up
    a fresh server on the same ports, so the sweep goes on and the report records the crash."""

    def __init__(self, repository: Path, log_path: Path, description: str):
        self.repository, self.log_path, self.description = repository, log_path, description
        onnx_path = repository / "mimi_decoder" / "1" / "model.onnx"
        self.onnx_path = onnx_path if onnx_path.is_file() else None
        self.server = None
        self.crashes: list[str] = []

    @classmethod
    def prepare(cls, args) -> LocalServer:
        """Export (when stale) and render the repository `args` ask for; the server is not started."""
        try:
            from mimi_code2wav.export.pipeline import prepare_local_repository
        except ImportError as exc:
            raise ClientError(f"starting a local server needs the serve and export extras ({exc}); or pass --url") from None
        build_dir = Path(args.build_dir)
        serving = serving_from_args(args, args.decoder)
        if args.instance_kind is None:
            serving.instance_kind = "KIND_CPU"  # a local server's decoder runs on the CPU, whatever its target
        repository = prepare_local_repository(args.weights, args.weights is None, 0, build_dir, target=args.decoder,
                                              serving=serving)
        log_path = build_dir / "tritonserver.log"
        return cls(repository, log_path, f"local tritonserver 2.51 (pytriton wheel), {args.decoder} decoder, "
                   f"{args.front_instances} code2wav instance(s), batcher waits {args.front_queue_delay_us} us "
                   f"(code2wav) / {args.max_queue_delay_us} us (decoder), log {shown_path(log_path)}")

    def start(self, ports: dict | None = None) -> None:
        from mimi_code2wav.server.triton import running_server

        self._context = running_server(self.repository, log_path=self.log_path, ready_timeout_s=120.0, **(ports or {}))
        self.server = self._context.__enter__()

    def stop(self) -> None:
        if self.server is not None:
            self._context.__exit__(None, None, None)
            self.server = None

    def restart(self) -> str:
        """Record why the server died, keep its log, start a new one on the same ports."""
        server = self.server
        code = server.process.poll()
        tail = log_tail(self.log_path, 40).splitlines()
        # From the signal line on, if any, keeping the stack frames that name a function (the others
        # are bare addresses in the stripped libtritonserver).
        signal_lines = [i for i, line in enumerate(tail) if "Signal (" in line]
        if signal_lines:
            tail = [line for line in tail[signal_lines[-1]:] if not re.search(r"#\s+0x[0-9A-Fa-f]+ in ", line)]
        tail = tail[-8:]
        crashed_log = self.log_path.with_name(f"{self.log_path.stem}.crash{len(self.crashes) + 1}.log")
        why = (f"tritonserver exited during the run (code {code}{': SIGSEGV' if code == -11 else ''}); log "
               f"kept as {shown_path(crashed_log)}:\n" + "\n".join(tail))
        self.crashes.append(why)
        self.stop()
        if self.log_path.exists():
            self.log_path.replace(crashed_log)
        self.start(dict(http_port=server.http_port, grpc_port=server.grpc_port, metrics_port=server.metrics_port))
        return why

    @property
    def url(self) -> str:
        return self.server.grpc_url

    def profile(self) -> PointProfile:
        return PointProfile(self.server.pid, self.server.metrics_url)


ORT_DTYPES = {"tensor(int32)": np.int32, "tensor(float16)": np.float16, "tensor(float)": np.float32}


def decoder_step_ms(onnx_path: Path, frame_counts: list[int], seconds: float = 1.0) -> dict[int, float]:
    """Milliseconds per call of the ONNX step alone in ONNX Runtime, batch 1, for each frame count."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    rng = np.random.default_rng(0)
    result = {}
    for frames in frame_counts:
        feeds = {arg.name: np.zeros([1, *arg.shape[1:]], ORT_DTYPES[arg.type]) for arg in inputs[1:]}
        feeds[inputs[0].name] = rng.integers(0, 2048, (1, 8, frames)).astype(np.int32)
        result[frames] = timed(lambda: session.run(None, feeds), seconds) * 1000  # noqa: B023 (timed here)
    return result


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Which server a benchmark measures: a running one (`--url`, or $URL as perf.sh reads it), else
    a local one of its own (`--decoder`, `--weights`, `--build-dir` and the serving flags of render)."""
    parser.add_argument("--url", default=os.environ.get("URL") or None,
                        help="Triton gRPC address of a running server (default: $URL, else start a local one)")
    parser.add_argument("--decoder", choices=LOCAL_TARGETS, default="python-ort",
                        help="the local server's decoder: python-ort, onnxruntime (Triton's native backend, from "
                        "$ORT_BACKEND) or null, the front's own ceiling (default %(default)s)")
    parser.add_argument("--weights", help="weights for the local server (default: seeded random weights)")
    parser.add_argument("--build-dir", default=str(REPO_ROOT / "build" / "bench"), help="export folder of the local server")
    add_serving_arguments(parser)


@contextlib.contextmanager
def measured_server(args: argparse.Namespace) -> Iterator[LocalServer | None]:
    """The local server `add_server_arguments` asks for, started and stopped around the block; None
    with `--url`."""
    local = None
    try:
        if not args.url:
            print("starting a local server ...", file=sys.stderr, flush=True)
            local = LocalServer.prepare(args)
            local.start()
        yield local
    finally:
        if local is not None:
            local.stop()
