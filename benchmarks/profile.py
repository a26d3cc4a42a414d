"""Which server a Triton benchmark measures (a running one at `--url`, else its own, rendered into its build
folder and started by `running_server`) and what a point cost it: CPU time per process of its group (/proc)
and Triton's per-model statistics (its metrics); `process_role` names the processes, for this and `memory`."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path

from mimi_code2wav.client.credentials import PLAINTEXT, Credentials
from mimi_code2wav.client.protocol import ClientError
from mimi_code2wav.export.render import add_serving_arguments, serving_from_args
from mimi_code2wav.server.processes import group_pids
from mimi_code2wav.server.serve import LOCAL_TARGETS
from mimi_code2wav.server.triton import fetch_metrics, metric_value

from .provenance import REPO_ROOT, log, run_meta

SERVER_ROLES = ("tritonserver", "stub code2wav", "stub mimi_decoder")
TRITON_TIMES = ("queue", "compute_input", "compute_infer", "compute_output")


def prepare_server(args: argparse.Namespace) -> Path:
    """Export (when stale) and render the repository `args` ask for, into `--build-dir`."""
    try:
        from mimi_code2wav.export.pipeline import prepare_local_repository
    except ImportError as exc:
        raise ClientError(f"starting a local server needs the serve and export extras ({exc}); or pass --url") from None
    serving = serving_from_args(args, args.decoder)
    serving.instance_kind = args.instance_kind or "KIND_CPU"  # a local decoder runs on the CPU, whatever its target
    return prepare_local_repository(args.weights, args.weights is None, 0, Path(args.build_dir), target=args.decoder,
                                    serving=serving)


def local_server(repository: Path) -> contextlib.AbstractContextManager:
    """A tritonserver of `repository` on free loopback ports for the block, its log beside the repository."""
    from mimi_code2wav.server.supervise import running_server

    return running_server(repository, log_path=Path(repository).parent / "tritonserver.log", ready_timeout_s=120.0)


def add_server_arguments(parser: argparse.ArgumentParser, url: bool = True, build_dir: str = "bench",
                         out_dir: str = "bench_results") -> None:
    """A running server (`--url`, or $URL as perf.sh reads it), else a local one of its own; where results go."""
    if url:
        parser.add_argument("--url", default=os.environ.get("URL") or None,
                            help="Triton gRPC address of a running server (default: $URL, else start a local one)")
    parser.add_argument("--decoder", choices=LOCAL_TARGETS, default="python-ort",
                        help="the local server's decoder: python-ort, onnxruntime (Triton's native backend, from "
                        "$ORT_BACKEND) or null, the front's own ceiling (default %(default)s)")
    parser.add_argument("--weights", help="weights for the local server (default: seeded random weights)")
    parser.add_argument("--build-dir", type=Path, default=REPO_ROOT / "build" / build_dir,
                        help="export folder of the local server")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / out_dir, help=f"where results go (default {out_dir}/)")
    add_serving_arguments(parser)


@contextlib.contextmanager
def measured_server(args: argparse.Namespace, credentials: Credentials = PLAINTEXT) -> Iterator[tuple]:
    """(the local server `add_server_arguments` asks for, None with `--url`; its gRPC address), answering."""
    from mimi_code2wav.client.sync import Code2WavClient

    if not args.url:
        log("starting a local server ...")
    with contextlib.nullcontext() if args.url else local_server(prepare_server(args)) as server:
        url = args.url or server.grpc_url
        Code2WavClient(url, credentials=credentials).check_ready()  # a bad address or credential stops here, in one line
        yield server, url


def server_meta(benchmark: str, args: argparse.Namespace, server, **fields) -> dict:
    """The stamp of a run on a local `server` (kind BENCHMARK-DECODER), else on the one at `--url` (BENCHMARK-url)."""
    if server is None:
        return run_meta(f"{benchmark}-url", decoder=None, server=f"running server at {args.url}", **fields)
    log_path = server.log_path.resolve()
    return run_meta(f"{benchmark}-{args.decoder}", decoder=args.decoder, server=(
        f"local tritonserver 2.51 (pytriton wheel), {args.decoder} decoder, {args.front_instances} code2wav instance(s), "
        f"batcher waits {args.front_queue_delay_us} us (code2wav) / {args.max_queue_delay_us} us (decoder), log "
        f"{log_path.relative_to(REPO_ROOT) if log_path.is_relative_to(REPO_ROOT) else log_path}"), **fields)


def process_role(pid: int) -> str:
    """'tritonserver', or 'stub <model>' for a Python backend stub; '?' when the process is gone."""
    with contextlib.suppress(OSError):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        name = Path(argv[0].decode(errors="replace")).name
        if name == "triton_python_backend_stub" and len(argv) > 1:  # argv[1] is .../<model>/<version>/model.py
            return f"stub {Path(argv[1].decode(errors='replace')).parent.parent.name}"
        return name
    return "?"


def settle_gc() -> None:
    """Collect, then freeze the survivors: a full collection of the load generator's objects stalls every stream."""
    gc.collect()
    gc.freeze()


class PointProfile:
    """What one point cost: the CPU time of each process of process group `pgid` and of the load generator,
    and Triton's statistics of `models` (the front first) at `metrics_url`; either None: its fields are missing."""

    MODELS = ("code2wav", "mimi_decoder")

    def __init__(self, pgid: int | None, metrics_url: str | None, models: tuple[str, ...] = MODELS):
        self._pgid, self._metrics_url, self.models = pgid, metrics_url, models

    def _read(self) -> dict:
        state = {"monotonic": time.monotonic(), "load_cpu_s": sum(os.times()[:4])}  # user and system, children's too
        if self._pgid is not None:  # CPU time (user + system, all threads) of each role, instances added up
            state["cpu_s"] = cpu_s = {}
            for pid in group_pids(self._pgid):
                with contextlib.suppress(OSError, ValueError, IndexError):  # utime, stime: 12th, 13th after the ")"
                    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                    role = process_role(pid)
                    cpu_s[role] = cpu_s.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if self._metrics_url is not None:
            with contextlib.suppress(OSError):
                samples = fetch_metrics(self._metrics_url)
                state["triton"] = {
                    model: {name: metric_value(samples, f"nv_inference_{name}", model=model) or 0.0
                            for name in ("request_success", "exec_count", *(f"{t}_duration_us" for t in TRITON_TIMES))}
                    for model in self.models}
        return state

    def start(self) -> PointProfile:
        settle_gc()
        self._before = self._read()
        return self

    def finish(self, requests: int) -> dict:
        """The point's profile; `requests`: the load generator's count (Triton's wins, once its front has them all)."""
        before, after, deadline, front = self._before, self._read(), time.monotonic() + 10.0, self.models[0]
        while ("triton" in before and "triton" in after and time.monotonic() < deadline
               and after["triton"][front]["request_success"] - before["triton"][front]["request_success"] < requests):
            time.sleep(0.05)
            after["triton"] = self._read().get("triton", after["triton"])
        wall_s = after["monotonic"] - before["monotonic"]
        profile: dict = {"wall_s": wall_s}
        if "triton" in before and "triton" in after:
            for model in self.models:
                delta = {name: value - before["triton"][model][name] for name, value in after["triton"][model].items()}
                done, executions = delta["request_success"], delta["exec_count"]
                # Triton charges each request of a batch the whole execution's compute: its mean is per execution.
                compute_us = sum(delta[f"compute_{t}_duration_us"] for t in ("input", "infer", "output"))
                profile[model] = {"requests": done, "executions": executions,
                                  "mean_batch": done / executions if executions else None,
                                  "execute_ms": compute_us / done / 1e3 if done else None,
                                  "queue_ms_per_request": delta["queue_duration_us"] / done / 1e3 if done else None}
            requests = int(profile[self.models[0]]["requests"]) or requests
        profile["requests"] = requests
        if requests:
            profile["load_cpu_ms_per_request"] = (after["load_cpu_s"] - before["load_cpu_s"]) / requests * 1e3
            if "cpu_s" in before:
                per_role = {role: (after["cpu_s"].get(role, 0.0) - before["cpu_s"].get(role, 0.0)) / requests * 1e3
                            for role in after["cpu_s"]}
                profile.update(server_cpu_ms_per_request=per_role, server_cpu_ms_per_request_total=sum(per_role.values()),
                               server_cpu_cores_busy=sum(per_role.values()) * requests / 1e3 / wall_s if wall_s else None)
        return profile


def point_profile(server, models: tuple[str, ...] = PointProfile.MODELS) -> PointProfile:
    """The profile of a point on a local `server` (`models`: the front first); of the load generator alone without."""
    return PointProfile(server.pid, server.metrics_url, models) if server else PointProfile(None, None)
