"""`python -m benchmarks duplex`: the duplex tick, what a full-duplex speech pipeline feels.

N conversations tick together, each producing one frame every 80 ms and wanting its PCM within the
playout budget past the moment its request could leave. Per policy (how frames become requests:
per-frame, ramp 1+5 as vLLM-Omni's PersonaPlex sends, catch-up) the conversations grow through
`--conversations` until a point misses the budget at p99, each point profiled; then the asyncio and
the thread client run per-frame at `--compare-at` conversations. Writes OUT_DIR/duplex.json and duplex.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from mimi_code2wav.client.credentials import PLAINTEXT, Credentials, add_credentials_arguments, credentials_from_args
from mimi_code2wav.client.protocol import FRAME_DURATION_S, MODEL_NAME, SAMPLES_PER_FRAME, StreamOptions
from mimi_code2wav.client.report import percentiles

from .profile import add_server_arguments, measured_server, point_profile, server_meta, settle_gc
from .provenance import add_options, log, md_row, parse_counts, write_run


@dataclass(frozen=True)
class Policy:
    """How a conversation's produced frames become requests: `first_frames`, then `chunk_frames` each;
    with `catch_up`, one request in flight carrying every frame produced since the last."""

    first_frames: int = 1
    chunk_frames: int = 1
    catch_up: bool = False

    def chunk_end(self, frame: int, total: int) -> int:
        """The frame after the request that holds frame `frame` (without catch-up)."""
        if frame < self.first_frames:
            return min(total, self.first_frames)
        return min(total, frame + self.chunk_frames - (frame - self.first_frames) % self.chunk_frames)

    def frames_to_send(self, produced: int, sent: int, total: int) -> int:
        """Frames to send now, given `produced` frames exist and `sent` were sent (0: wait)."""
        if produced <= sent or self.catch_up:
            return max(0, produced - sent)
        stop = self.chunk_end(sent, total)
        return stop - sent if produced >= stop else 0

    def due_s(self, frame: int, total: int, start_s: float) -> float:
        """When frame `frame`'s request may leave at the earliest: the tick of its chunk's last frame."""
        return start_s + (frame if self.catch_up else self.chunk_end(frame, total) - 1) * FRAME_DURATION_S

    @property
    def label(self) -> str:
        return "catch-up" if self.catch_up else "per-frame" if self.first_frames == self.chunk_frames == 1 else (
            f"ramp {self.first_frames}+{self.chunk_frames}")


PER_FRAME, RAMP, CATCH_UP = Policy(), Policy(first_frames=1, chunk_frames=5), Policy(catch_up=True)
POLICIES = {"per-frame": PER_FRAME, "ramp": RAMP, "catch-up": CATCH_UP}


def summarize(client: str, policy: Policy, arrival_s: np.ndarray, start_s: float, budget_ms: float,
              cpu_s: float, wall_s: float, failed: str | None = None) -> dict:
    """A run's result from when each frame's PCM arrived ([conversations, frames], NaN: never): latency from its
    tick and lateness from its due time, misses (past the budget or never), requests, the client's CPU per request."""
    frames = arrival_s.shape[1]
    ticks = start_s + np.arange(frames) * FRAME_DURATION_S
    due = np.array([policy.due_s(j, frames, start_s) for j in range(frames)])
    done = ~np.isnan(arrival_s)
    late_ms = ((arrival_s - due) * 1e3)[done]
    requests = sum(len(np.unique(row[~np.isnan(row)])) for row in arrival_s)
    result = {"client": client, "policy": policy.label, "conversations": len(arrival_s), "frames": frames,
              "budget_ms": budget_ms, "latency_ms": percentiles(((arrival_s - ticks) * 1e3)[done], empty=math.nan),
              "late_ms": percentiles(late_ms, empty=math.nan),
              "misses": int((late_ms > budget_ms).sum()) + int((~done).sum()), "requests": requests,
              "client_cpu_ms_per_request": cpu_s * 1e3 / max(requests, 1), "wall_s": wall_s, "failed": failed}
    return {**result, "meets_budget": failed is None and result["late_ms"]["p99"] <= budget_ms}


def _conversation(codes: np.ndarray, policy: Policy, start_s: float, arrival_s: np.ndarray
                  ) -> Generator[float | tuple[np.ndarray, bool], np.ndarray | None, None]:
    """One conversation's schedule, without I/O: yields a wait (seconds) or a request (its codes, END),
    and is sent the request's PCM back, which it checks, noting when it came in `arrival_s`."""
    total, sent = codes.shape[1], 0
    while sent < total:
        now = time.perf_counter()
        produced = min(total, int((now - start_s) / FRAME_DURATION_S) + 1) if now >= start_s else 0
        count = policy.frames_to_send(produced, sent, total)
        if count == 0:
            yield max(0.0, start_s + produced * FRAME_DURATION_S - now)
            continue
        pcm = yield codes[:, sent : sent + count], sent + count == total
        arrival_s[sent : sent + count] = time.perf_counter()
        if pcm.size != count * SAMPLES_PER_FRAME:
            raise RuntimeError(f"expected {count * SAMPLES_PER_FRAME} samples, got {pcm.size}")
        sent += count


def run_point(url: str, conversations: int, frames: int, policy: Policy, budget_ms: float, threads: bool = False,
              credentials: Credentials = PLAINTEXT, model_name: str = MODEL_NAME) -> dict:
    """The conversations on the asyncio client (one channel, a task each), or with `threads` a thread and connection each."""
    from mimi_code2wav.client import aio, sync

    rng = np.random.default_rng(0)
    codes = [rng.integers(0, 2048, (8, frames), dtype=np.int64) for _ in range(conversations)]
    arrival_s = np.full((conversations, frames), np.nan)
    options = StreamOptions(model_name=model_name, response_timeout_s=30.0)
    stop_event, failures = threading.Event(), []

    def converse(index: int) -> None:  # in its own thread: one failure stops the run
        try:
            with contextlib.suppress(StopIteration), client.stream() as stream:
                step = next(steps[index])
                while not stop_event.is_set():
                    step = steps[index].send(stop_event.wait(step) if isinstance(step, float) else stream.decode(*step))
        except Exception as exc:
            failures.append(f"conversation {index}: {exc}")
            stop_event.set()

    async def converse_async(index: int, stream) -> None:
        with contextlib.suppress(StopIteration):
            step = next(steps[index])
            while True:
                step = steps[index].send(await (asyncio.sleep(step) if isinstance(step, float) else stream.decode(*step)))

    async def main() -> None:
        async with aio.Code2WavClient(url, options, credentials=credentials) as client:
            tasks = [asyncio.create_task(converse_async(index, client.stream())) for index in range(conversations)]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
            failures.extend(f"conversation {tasks.index(t)}: {t.exception()}" for t in done if t.exception())

    start_s, cpu_start_s = time.perf_counter() + 0.5, time.process_time()
    steps = [_conversation(c, policy, start_s, arrival_s[index]) for index, c in enumerate(codes)]
    if threads:
        client = sync.Code2WavClient(url, options, credentials=credentials)
        with ThreadPoolExecutor(conversations) as pool:
            list(pool.map(converse, range(conversations)))
    else:
        asyncio.run(main())
    return summarize("threads" if threads else "asyncio", policy, arrival_s, start_s, budget_ms,
                     time.process_time() - cpu_start_s, time.perf_counter() - start_s, (failures or [None])[0])


def parse_policies(text: str) -> list[Policy]:
    if unknown := [name for name in text.split(",") if name.strip() not in POLICIES]:
        raise argparse.ArgumentTypeError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    return [POLICIES[name.strip()] for name in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, out_dir="bench_results/duplex")
    add_credentials_arguments(parser)  # for --url: a server with TLS or a key
    add_options(parser, ("--conversations", "4,8,16,32,64,128,200",
                         "conversations per point, tried in turn until one misses", parse_counts),
                ("--policies", "per-frame,ramp,catch-up", f"comma-separated, of {', '.join(POLICIES)}", parse_policies),
                ("--seconds", 8.0, "length of each conversation"),
                ("--budget-ms", 80.0, "playout budget: how late past its due time a frame's PCM may be"),
                ("--compare-at", 32, "conversations at which the asyncio and the thread client both run (0: skip)"))
    parser.add_argument("--keep-going", action="store_true",
                        help="measure every count of --conversations, also past the first that misses")


def _logged(result: dict) -> dict:
    latency = result["latency_ms"]
    log(f"  {result['client']:8} {result['policy']:10} {result['conversations']:4} conversations: frame latency "
        f"p50/p99/max {latency['p50']:.0f}/{latency['p99']:.0f}/{latency['max']:.0f} ms, late p99 "
        f"{result['late_ms']['p99']:.0f} ms, {result['misses']} misses, {result['client_cpu_ms_per_request']:.2f} ms "
        "client CPU/request" + (f" FAILED: {result['failed']}" if result["failed"] else ""))
    return result


# An unmeasured warm-up this many ticks long pays a server's one-off costs (sequence slots, state rows, first batches).
WARM_UP_FRAMES = 6


def run(args: argparse.Namespace) -> int:
    frames = max(2, round(args.seconds / FRAME_DURATION_S))
    client = {"budget_ms": args.budget_ms, "credentials": credentials_from_args(args)}
    points, most, compared = [], {}, []
    with measured_server(args, client["credentials"]) as (local, url):
        warm_up = run_point(url, max(args.conversations), WARM_UP_FRAMES, PER_FRAME, **client)
        log(f"  warm-up ({warm_up['conversations']} conversations, {WARM_UP_FRAMES} frames each, not measured)"
            + (f" FAILED: {warm_up['failed']}" if warm_up["failed"] else ""))
        for policy in args.policies:
            most[policy.label] = 0
            for count in args.conversations:
                profile = point_profile(local).start()
                result = _logged(run_point(url, count, frames, policy, **client))
                points.append({**result, "profile": profile.finish(result["requests"])})
                if result["meets_budget"] and all(p["meets_budget"] for p in points if p["policy"] == policy.label):
                    most[policy.label] = count
                elif not args.keep_going:
                    break
        for threads in (False, True) if args.compare_at else ():
            settle_gc()
            compared.append(_logged(run_point(url, args.compare_at, frames, PER_FRAME, threads=threads, **client)))
    results = {"meta": server_meta("duplex", args, local, budget_ms=args.budget_ms), "points": points,
               "most_conversations": most, "compared": compared, "frames": frames,
               "warm_up": {"conversations": warm_up["conversations"], "frames": WARM_UP_FRAMES}}
    write_run(args.out_dir, "duplex", results, duplex_markdown(results))
    return 1 if any(point["failed"] for point in points + compared) else 0


def _where_the_time_goes(point: dict) -> str:
    profile = point.get("profile") or {}
    parts = [f"{model}: queue {figures['queue_ms_per_request']:.1f} ms, execution {figures['execute_ms']:.1f} ms at "
             f"batch {figures['mean_batch']:.1f}"
             for model in ("code2wav", "mimi_decoder") if (figures := profile.get(model)) and figures.get("requests")]
    if profile.get("server_cpu_cores_busy") is not None:
        parts.append("server CPU per request " + ", ".join(
            f"{role} {ms:.2f} ms" for role, ms in profile["server_cpu_ms_per_request"].items())
            + f" ({profile['server_cpu_cores_busy']:.2f} cores busy)")
    return "; ".join([*parts, f"load generator {point['client_cpu_ms_per_request']:.2f} ms CPU per request"])


def duplex_markdown(results: dict) -> str:
    """The duplex table, the most conversations per policy, each first miss's profile, the two clients (no stamp)."""
    meta = results["meta"]
    lines = [
        f"{meta.get('server', '')}. Conversations tick together every 80 ms, one frame each per tick, "
        f"{results['frames']} frames each; latency from a frame's tick to its PCM; late = past the moment "
        f"its request could leave; a miss is a frame later than the {meta['budget_ms']:g} ms budget; after an "
        "unmeasured warm-up, the load generator's objects frozen before each point (`gc.freeze`).",
        "",
        "| policy | conversations | frame latency p50 / p99 / max ms | late p99 ms | misses | requests | client CPU ms / request |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [md_row(p["policy"], p["conversations"], "{p50:.0f} / {p99:.0f} / {max:.0f}".format(**p["latency_ms"]),
                     f"{p['late_ms']['p99']:.0f}", p["misses"], p["requests"], f"{p['client_cpu_ms_per_request']:.2f}"
                     + (f" (failed: {p['failed']})" if p["failed"] else "")) for p in results["points"]]
    lines += ["", "Most conversations within the budget at p99: "
              + ", ".join(f"{policy} {count}" for policy, count in results["most_conversations"].items()) + "."]
    first_misses = {p["policy"]: p for p in reversed(results["points"]) if not p["meets_budget"]}
    lines += [f"- Where the time goes at {point['conversations']} conversations, {policy}: {_where_the_time_goes(point)}."
              for policy, point in reversed(first_misses.items())]
    if results["compared"]:
        lines += ["", "| client, per-frame | conversations | frame latency p50 / p99 ms | client CPU ms / request |",
                  "|---|---:|---:|---:|"]
        lines += [md_row(point["client"], point["conversations"],
                         f"{point['latency_ms']['p50']:.0f} / {point['latency_ms']['p99']:.0f}",
                         f"{point['client_cpu_ms_per_request']:.2f}") for point in results["compared"]]
    return "\n".join(lines)
