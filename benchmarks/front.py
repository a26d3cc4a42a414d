"""`python -m benchmarks front`: what the code2wav front costs per request, and where it goes.

    python -m benchmarks front [--instances 1 2] [--conversations 64] [--seconds 8]
                               [--unpaced 32] [--rounds 3] [--rate 200] [--out-dir bench_results/front]

The null decoder answers at once, so what is left is the front. For each count of front instances
(`--instances`), one local server holds code2wav and `minimal_front` (benchmarks/minimal_front: one
`async_exec` per request and nothing else, the cheapest Python BLS front there is), both in front of
the null decoder, with as many instances each. On it:

1. Throughput against the minimal front: `--unpaced` conversations of 1-frame requests, each sent
   when the previous one is answered, for `--seconds`, code2wav and the minimal front in turn (ABAB,
   `--rounds` rounds); requests/s and the ratio (median of the rounds).
2. Live load, measured: `--conversations` per-frame conversations ticking every 80 ms (duplex's
   asyncio driver) through each front: frame latency, Triton's queue and execution times, the CPU
   per request of every process (tritonserver, each model's stub, the load generator).
3. Live load, sampled: the same again while py-spy samples each front's stubs (`--rate` Hz,
   `--nonblocking`: the stub is never paused; py-spy leaves out idle threads, but a thread blocked
   in C, waiting for a decoder answer or for its next call, is sampled). A sample is charged to
   numpy, or to a pb_utils call (a thread running a decoder call, or a line of the front whose
   text calls into the Python backend's C++: tensors, requests, responses, metrics; their IPC with
   tritonserver included), or to the front's own Python, or to asyncio and the threads (a thread
   waiting for its next call included). Each share times the measured stub CPU per request is that
   part's CPU per request; the front's busiest lines are listed with their text.

py-spy needs ptrace rights over the stubs (root, or kernel.yama.ptrace_scope 0); without them the
sampled part is skipped and the table says why. Client and server share the cores. Writes front.md
and front.json to the out-dir (`python -m benchmarks record --add` records it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mimi_code2wav.client.protocol import FRAME_DURATION_S, StreamOptions, random_codes
from mimi_code2wav.export.render import COMMON_DIR
from mimi_code2wav.server.processes import group_pids

from .duplex import PER_FRAME, run_async
from .local_server import LocalServer, add_server_arguments
from .profile import PointProfile, process_role, settle_gc
from .provenance import REPO_ROOT, command_line, run_meta, write_run

FRONTS = ("code2wav", "minimal_front")
MINIMAL_FRONT = Path(__file__).resolve().parent / "minimal_front" / "model.py"
# Beside it as beside every Python model: the stub's fault handler and its collection at unload.
MODEL_LIFECYCLE = COMMON_DIR / "model_lifecycle.py"
# Where a sample's CPU goes, in the order the report lists them.
PB_UTILS = "pb_utils calls (C++, IPC with tritonserver)"
PARTS = (PB_UTILS, "front Python", "numpy", "asyncio and threads", "other")
WORK_PARTS = PARTS[:3]  # the front's own work: its busiest lines are counted from these
# A line of a front that calls into the Python backend's C++: tensors, requests, responses, metrics.
# (code2wav's decoder-call threads run nothing but decoder calls: `blocking_call()` is `request.exec`.)
PB_UTILS_CALL = re.compile(r"pb_utils\.|\.send\(|\.exec\b|async_exec|\.increment\(|as_numpy\(|get_response_sender|blocking_call\(\)")
# code2wav's decoder-call threads waiting for their next call (the work queue of an executor's threads).
THREAD_WAIT = re.compile(r"_calls\.get\(\)")


# ---- py-spy samples --------------------------------------------------------------------------------

def parse_raw(text: str) -> collections.Counter:
    """py-spy's raw format (`frame;frame;...;frame COUNT`, outermost first; a frame reads `function
    (file:line)`) -> Counter of stacks."""
    stacks: collections.Counter = collections.Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def _location(frame: str) -> tuple[str, str, int]:
    """(function, file, line) of a frame."""
    function, _, location = frame.rpartition(" (")
    file_name, _, line = location.rstrip(")").rpartition(":")
    return function, file_name, int(line) if line.isdigit() else 0


def _source_key(frame: str) -> tuple[str, int]:
    """(file name, line) of a frame: how `sources` keys a line."""
    _, file_name, line = _location(frame)
    return os.path.basename(file_name), line


def sources(model_folder: Path) -> dict[tuple[str, int], str]:
    """(file name, line number) -> the line, for every Python file a served model's folder holds."""
    return {(path.name, number): text for path in model_folder.glob("*.py")
            for number, text in enumerate(path.read_text().splitlines(), 1)}


def sample_part(stack: tuple[str, ...], front_sources: dict[tuple[str, int], str]) -> str:
    """The part of the stub a sample ran in (module docstring): innermost numpy or the thread pool's
    work item (a BLS `exec`) first, else the innermost line of the front's own files (a pb_utils call
    by its text, a decoder-call thread waiting for work, else the front's Python), else the innermost
    asyncio or threading frame."""
    function, file_name, _ = _location(stack[-1])
    if "numpy/" in file_name:
        return "numpy"
    if file_name.endswith("concurrent/futures/thread.py") and function == "run":
        return PB_UTILS  # the pool runs nothing but decoder calls (request.exec, async_exec)
    for frame in reversed(stack):
        _, file_name, _ = _location(frame)
        text = front_sources.get(_source_key(frame))
        if text is not None:
            if THREAD_WAIT.search(text):
                return "asyncio and threads"
            return PB_UTILS if PB_UTILS_CALL.search(text) else "front Python"
        if "asyncio/" in file_name or os.path.basename(file_name) in ("threading.py", "thread.py", "_base.py", "queue.py"):
            return "asyncio and threads"
    return "other"


def charge(stacks: collections.Counter, front_sources: dict[tuple[str, int], str]) -> tuple[dict, list]:
    """Samples per part, and the busiest innermost lines of the front's own files as (frame, the
    line's text, samples), from the samples of its work (a thread waiting for its next call is not)."""
    parts = dict.fromkeys(PARTS, 0)
    lines: collections.Counter = collections.Counter()
    for stack, count in stacks.items():
        part = sample_part(stack, front_sources)
        parts[part] += count
        own = next((f for f in reversed(stack) if _source_key(f) in front_sources), None)
        if own is not None and part in WORK_PARTS:
            lines[own] += count
    busiest = [(frame, front_sources[_source_key(frame)].strip(), count) for frame, count in lines.most_common(10)]
    return parts, busiest


def py_spy() -> str | None:
    """The py-spy of this environment (beside its python), else the one on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


class Sampler:
    """py-spy recording each stub of `role` of a server's process group, from its return (every py-spy
    has attached and says it samples) until `stop()`."""

    def __init__(self, pgid: int, role: str, rate: int, folder: Path):
        self.pids = [pid for pid in group_pids(pgid) if process_role(pid) == role]
        self.outputs = [folder / f"{role.replace(' ', '-')}-{pid}.txt" for pid in self.pids]
        self._processes = [
            subprocess.Popen([py_spy() or "py-spy", "record", "--pid", str(pid), "--nonblocking", "--format",
                              "raw", "--rate", str(rate), "--output", str(output)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for pid, output in zip(self.pids, self.outputs)]
        self._said = [self._attached(process) for process in self._processes]

    @staticmethod
    def _attached(process: subprocess.Popen) -> str:
        """What py-spy said until it began sampling (attaching takes a while on a busy machine) or exited."""
        said = []
        while (line := process.stdout.readline()) and not line.startswith("py-spy> Sampling"):
            said.append(line)
        return "".join(said)

    def stop(self) -> collections.Counter:
        stacks: collections.Counter = collections.Counter()
        for process, output, said in zip(self._processes, self.outputs, self._said):
            process.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
            errors = said + process.communicate(timeout=60)[0]
            if not output.is_file():
                raise RuntimeError(f"py-spy wrote no samples: {errors.strip().splitlines()[-1:] or process.returncode}")
            stacks.update(parse_raw(output.read_text()))
        return stacks


def py_spy_problem() -> str | None:
    """Why py-spy cannot sample the stubs here, or None."""
    if py_spy() is None:
        return "py-spy is not installed (the serve extra pins it: make venv)"
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if os.geteuid() != 0 and scope.exists() and scope.read_text().strip() != "0":
        return "py-spy needs ptrace rights over the stubs: run as root, or with kernel.yama.ptrace_scope 0"
    return None


# ---- the runs --------------------------------------------------------------------------------------

def unpaced_requests_per_s(url: str, model_name: str, conversations: int, seconds: float) -> float:
    """Requests/s of `conversations` 1-frame conversations of `model_name` for `seconds`, each sending
    its next request when the last is answered."""
    from mimi_code2wav.client.aio import Code2WavClient

    async def conversation(client, codes, until: float) -> int:
        answered = 0
        async with client.stream() as stream:
            while time.monotonic() < until:
                await stream.decode(codes[:, answered % codes.shape[1]][:, None])
                answered += 1
        return answered

    async def main() -> int:
        async with Code2WavClient(url, StreamOptions(model_name=model_name)) as client:
            await client.check_ready()
            until = time.monotonic() + seconds
            return sum(await asyncio.gather(*(conversation(client, random_codes(64, seed=i), until)
                                              for i in range(conversations))))

    began = time.monotonic()
    count = asyncio.run(main())
    return count / (time.monotonic() - began)


def add_minimal_front(repository: Path) -> None:
    """Serve `minimal_front` beside code2wav: code2wav's rendered config (same inputs, batching and
    instances) under the other name, its model file and model_lifecycle.py."""
    folder = repository / "minimal_front"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "1").mkdir(parents=True)
    config = (repository / "code2wav" / "config.pbtxt").read_text()
    (folder / "config.pbtxt").write_text(config.replace('name: "code2wav"', 'name: "minimal_front"', 1))
    shutil.copy(MINIMAL_FRONT, folder / "1" / "model.py")
    shutil.copy(MODEL_LIFECYCLE, folder / "1" / MODEL_LIFECYCLE.name)


def _live(local: LocalServer, front: str, args, sampler_folder: Path | None) -> dict:
    """One live point through `front`: the duplex result and its profile; with `sampler_folder`, the
    samples of the front's stubs instead of the profile."""
    frames = max(2, round(args.seconds / FRAME_DURATION_S))
    live = functools.partial(run_async, local.url, args.conversations, frames, PER_FRAME, args.budget_ms, model_name=front)
    settle_gc()
    if sampler_folder is None:
        profile = PointProfile(local.server.pid, local.server.metrics_url, models=(front, "mimi_decoder"))
        profile.start()
        result = live()
        return {"result": result.as_dict(), "profile": profile.finish(result.requests)}
    sampler = Sampler(local.server.pid, f"stub {front}", args.rate, sampler_folder)
    result = live()
    parts, busiest = charge(sampler.stop(), sources(local.repository / front / "1"))
    return {"result": result.as_dict(), "samples": parts, "busiest_lines": busiest, "stubs": len(sampler.pids)}


def measure_instances(local: LocalServer, instances: int, args, sampling: str | None) -> dict:
    """Every part of the run for one count of front instances, on `local` (a null repository with
    that many front instances), run here with the minimal front added."""
    add_minimal_front(local.repository)
    point: dict = {"instances": instances, "rps": {front: [] for front in FRONTS}}
    with local.running():
        for front in FRONTS:  # warm-up
            unpaced_requests_per_s(local.url, front, args.unpaced, 1.0)
        for round_index in range(args.rounds):
            for front in FRONTS:
                point["rps"][front].append(unpaced_requests_per_s(local.url, front, args.unpaced, args.seconds))
            print(f"  {instances} instance(s), round {round_index + 1}: "
                  + ", ".join(f"{front} {point['rps'][front][-1]:.0f} requests/s" for front in FRONTS), flush=True)
        point["ratio"] = statistics.median(c / m for c, m in zip(point["rps"]["code2wav"], point["rps"]["minimal_front"]))
        point["live"] = {front: _live(local, front, args, None) for front in FRONTS}
        if sampling is None:
            with tempfile.TemporaryDirectory(prefix="front-samples-") as folder:
                point["sampled"] = {front: _live(local, front, args, Path(folder)) for front in FRONTS}
    for front in FRONTS:
        live = point["live"][front]["result"]
        print(f"  {instances} instance(s), {args.conversations} live conversations through {front}: late p99 "
              f"{live['late_ms']['p99']:.0f} ms, {live['misses']} misses", flush=True)
    return point


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.set_defaults(decoder="null", build_dir=str(REPO_ROOT / "build" / "bench-front"))
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 2], help="front instance counts (default 1 2)")
    parser.add_argument("--conversations", type=int, default=64, help="live per-frame conversations (default %(default)s)")
    parser.add_argument("--unpaced", type=int, default=32, help="unpaced 1-frame conversations (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each measurement (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="ABAB rounds of the throughput part (default %(default)s)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second (default %(default)s)")
    parser.add_argument("--budget-ms", type=float, default=80.0, help="playout budget of a frame (default %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench_results" / "front")


def run(args: argparse.Namespace) -> int:
    if args.url or args.decoder != "null":
        print("error: the front benchmark runs its own server with the null decoder (no --url, no --decoder)",
              file=sys.stderr)
        return 2
    sampling = py_spy_problem()
    if sampling:
        print(f"warning: {sampling}; the CPU breakdown is skipped", file=sys.stderr)
    points = []
    for count in args.instances:
        args.front_instances = count
        points.append(measure_instances(LocalServer.prepare(args), count, args, sampling))
    results = {"meta": run_meta("front", command_line()), "conversations": args.conversations, "unpaced": args.unpaced,
               "seconds": args.seconds, "rounds": args.rounds, "rate": args.rate, "budget_ms": args.budget_ms,
               "sampling": sampling, "points": points}
    write_run(args.out_dir, "front", results, front_markdown(results))
    return 1 if any(p["live"][f]["result"]["failed"] for p in points for f in FRONTS) else 0


# ---- the report ------------------------------------------------------------------------------------

def breakdown(point: dict, front: str) -> list[tuple[str, float]]:
    """(what, ms per request) of one front's live point: Triton's queue and execution, then the CPU
    of each process, the front's stubs split by the samples' shares."""
    profile = point["live"][front]["profile"]
    rows = []
    figures = profile.get(front) or {}
    if figures.get("requests"):
        rows += [("waiting in Triton's queue", figures["queue_ms_per_request"]),
                 ("execute (Triton's compute time of its batch)", figures["execute_ms"]),
                 ("(requests per execution)", figures["mean_batch"])]
    cpu = profile.get("server_cpu_ms_per_request", {})
    samples = (point.get("sampled") or {}).get(front, {}).get("samples")
    for role, label in (("tritonserver", "tritonserver"), (f"stub {front}", "front stub"), ("stub mimi_decoder", "decoder stub")):
        ms = cpu.get(role, 0.0)
        if label == "front stub" and samples and sum(samples.values()):
            total = sum(samples.values())
            rows += [(f"CPU: front stub, {part}", ms * count / total) for part, count in samples.items()]
        rows.append((f"CPU: {label}", ms))
    rows.append(("CPU: load generator", profile.get("load_cpu_ms_per_request", 0.0)))
    return rows


def front_markdown(results: dict) -> str:
    lines = ["Local tritonserver 2.51, the null decoder; code2wav and the minimal front (one async_exec per "
             "request) served side by side with as many instances each; client and server on the same cores.", "",
             f"Throughput: {results['unpaced']} unpaced conversations of 1-frame requests, {results['seconds']:g} s per "
             f"measurement, the two fronts in turn for {results['rounds']} rounds.", "",
             "| front instances | code2wav requests/s | minimal front requests/s | code2wav / minimal (median) |",
             "|---:|---:|---:|---:|"]
    for point in results["points"]:
        lines.append(f"| {point['instances']} | {statistics.median(point['rps']['code2wav']):.0f} | "
                     f"{statistics.median(point['rps']['minimal_front']):.0f} | {point['ratio']:.2f} |")
    lines += ["", f"Live: {results['conversations']} per-frame conversations ticking every 80 ms, "
              f"{results['seconds']:g} s; a miss is a frame more than {results['budget_ms']:g} ms late.", "",
              "| front instances | front | late p50 / p99 ms | misses | server CPU ms / request | cores busy |",
              "|---:|---|---:|---:|---:|---:|"]
    for point in results["points"]:
        for front, live in point["live"].items():
            result, profile = live["result"], live["profile"]
            lines.append(f"| {point['instances']} | {front} | {result['late_ms']['p50']:.0f} / {result['late_ms']['p99']:.0f} | "
                         f"{result['misses']} | {profile.get('server_cpu_ms_per_request_total', float('nan')):.3f} | "
                         f"{profile.get('server_cpu_cores_busy') or float('nan'):.2f} |")
    lines += ["", *sizing(results)]
    if results["sampling"]:
        lines += ["", f"CPU by part not measured: {results['sampling']}."]
    for point in results["points"]:
        lines += ["", f"Where a live request's time and CPU go, {point['instances']} front instance(s), py-spy at "
                  f"{results['rate']} Hz on the stubs:", "", "| | code2wav ms / request | minimal front ms / request |",
                  "|---|---:|---:|"]
        code2wav_rows, minimal_rows = (dict(breakdown(point, front)) for front in FRONTS)
        for what in dict.fromkeys([*code2wav_rows, *minimal_rows]):
            lines.append(f"| {what} | {_ms(code2wav_rows.get(what))} | {_ms(minimal_rows.get(what))} |")
        sampled = (point.get("sampled") or {}).get("code2wav")
        if sampled:
            lines += ["", "| code2wav's busiest lines (innermost of its own) | samples |", "|---|---:|"]
            lines += [f"| `{frame}`: `{text}` | {count} |" for frame, text, count in sampled["busiest_lines"]]
    return "\n".join(lines)


REQUESTS_PER_S_PER_CONVERSATION = 1 / FRAME_DURATION_S  # per-frame: one request per 80 ms frame


def sizing(results: dict) -> list[str]:
    """Host sizing from code2wav's live points: the server CPU a per-frame conversation costs, and the
    most conversations one front instance's process can carry (one core at most, under its GIL)."""
    lines = ["Sizing from the live code2wav runs (server CPU only; the null decoder, so the decoder's own "
             "cost comes on top; rerun on the serving host):", "",
             "| front instances | server CPU ms / request | per-frame conversations per server core | "
             "front stub CPU ms / request | per-frame conversations one front instance carries at most |",
             "|---:|---:|---:|---:|---:|"]
    for point in results["points"]:
        profile = point["live"]["code2wav"]["profile"]
        server_ms = profile.get("server_cpu_ms_per_request_total")
        stub_ms = profile.get("server_cpu_ms_per_request", {}).get("stub code2wav")
        if not server_ms or not stub_ms:
            continue
        per_core = 1000 / server_ms / REQUESTS_PER_S_PER_CONVERSATION
        stub_per_instance = 1000 / stub_ms / REQUESTS_PER_S_PER_CONVERSATION  # the stubs' CPU per request, any instance
        lines.append(f"| {point['instances']} | {server_ms:.3f} | {per_core:.0f} | {stub_ms:.3f} | {stub_per_instance:.0f} |")
    lines += ["", "Cores for N per-frame conversations: N x 12.5 requests/s x the server CPU per request; front "
              "instances: N over the last column, at least."]
    return lines


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"
