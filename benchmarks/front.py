"""`python -m benchmarks front`: what the code2wav front costs per request, and where it goes.

The null decoder answers at once, so what is left is the front. Per count of front instances, one local
server holds code2wav and `minimal_front` (one `async_exec` per request, the cheapest Python BLS front)
with as many instances each, and measures: requests/s of `--unpaced` conversations of 1-frame requests
through each front in turn (`--rounds` rounds); then `--conversations` live per-frame conversations
through each (duplex's driver), with Triton's statistics and the CPU time of every process per request.
Writes OUT_DIR/front.md and front.json."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
from pathlib import Path

from mimi_code2wav.client.protocol import FRAME_DURATION_S, StreamOptions, random_codes
from mimi_code2wav.export.render import COMMON_DIR

from .duplex import PER_FRAME, run_point
from .profile import add_server_arguments, local_server, point_profile, prepare_server
from .provenance import add_options, log, md_row, run_meta, write_run

FRONTS = ("code2wav", "minimal_front")


def unpaced_requests_per_s(url: str, model_name: str, conversations: int, seconds: float) -> float:
    """Requests/s of `conversations` unpaced 1-frame conversations of `model_name` for `seconds`."""
    from mimi_code2wav.client.aio import Code2WavClient

    async def conversation(client, codes, until: float) -> int:
        answered = 0
        async with client.stream() as stream:
            while time.monotonic() < until:
                await stream.decode(codes[:, answered % codes.shape[1]][:, None])
                answered += 1
        return answered

    async def main() -> float:
        async with Code2WavClient(url, StreamOptions(model_name=model_name)) as client:
            await client.check_ready()
            began = time.monotonic()
            count = sum(await asyncio.gather(*(conversation(client, random_codes(64, seed=i), began + seconds)
                                               for i in range(conversations))))
            return count / (time.monotonic() - began)

    return asyncio.run(main())


def measure_instances(repository: Path, instances: int, args) -> dict:
    """The run for one count of front instances on `repository` (rendered with that many), `minimal_front` served
    beside code2wav with code2wav's config (same inputs, batching and instances) under its own name."""
    folder = repository / "minimal_front"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "1").mkdir(parents=True)
    config = (repository / "code2wav" / "config.pbtxt").read_text()
    (folder / "config.pbtxt").write_text(config.replace('name: "code2wav"', 'name: "minimal_front"', 1))
    shutil.copy(Path(__file__).resolve().parent / "minimal_front" / "model.py", folder / "1" / "model.py")
    shutil.copy(COMMON_DIR / "model_lifecycle.py", folder / "1" / "model_lifecycle.py")
    point: dict = {"instances": instances, "rps": {front: [] for front in FRONTS}}
    with local_server(repository) as server:
        for front in FRONTS:  # warm-up
            unpaced_requests_per_s(server.grpc_url, front, args.unpaced, 1.0)
        for round_index in range(args.rounds):
            for front in FRONTS:
                point["rps"][front].append(unpaced_requests_per_s(server.grpc_url, front, args.unpaced, args.seconds))
            print(f"  {instances} instance(s), round {round_index + 1}: "
                  + ", ".join(f"{front} {point['rps'][front][-1]:.0f} requests/s" for front in FRONTS), flush=True)
        point["ratio"] = statistics.median(c / m for c, m in zip(point["rps"]["code2wav"], point["rps"]["minimal_front"]))
        point["live"] = {}
        for front in FRONTS:
            profile = point_profile(server, (front, "mimi_decoder")).start()
            result = run_point(server.grpc_url, args.conversations, max(2, round(args.seconds / FRAME_DURATION_S)), PER_FRAME,
                               args.budget_ms, model_name=front)
            point["live"][front] = {"result": result, "profile": profile.finish(result["requests"])}
            print(f"  {instances} instance(s), {args.conversations} live conversations through {front}: late p99 "
                  f"{result['late_ms']['p99']:.0f} ms, {result['misses']} misses", flush=True)
    return point


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, url=False, build_dir="bench-front", out_dir="bench_results/front")
    parser.set_defaults(decoder="null")
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 2], help="front instance counts (default 1 2)")
    add_options(parser, ("--conversations", 64, "live per-frame conversations"),
                ("--unpaced", 32, "unpaced 1-frame conversations"), ("--seconds", 8.0, "length of each measurement"),
                ("--rounds", 3, "ABAB rounds of the throughput part"), ("--budget-ms", 80.0, "playout budget of a frame"))


def run(args: argparse.Namespace) -> int:
    if args.decoder != "null":
        log("error: the front benchmark runs its own server with the null decoder (no --decoder)")
        return 2
    points = []
    for count in args.instances:
        args.front_instances = count
        points.append(measure_instances(prepare_server(args), count, args))
    results = {"meta": run_meta("front"), "conversations": args.conversations, "unpaced": args.unpaced,
               "seconds": args.seconds, "rounds": args.rounds, "budget_ms": args.budget_ms, "points": points}
    write_run(args.out_dir, "front", results, front_markdown(results))
    return 1 if any(p["live"][f]["result"]["failed"] for p in points for f in FRONTS) else 0


def breakdown(point: dict, front: str) -> dict[str, float]:
    """What ms per request of one front's live point: Triton's queue and execution, then each process's CPU."""
    profile = point["live"][front]["profile"]
    figures, cpu = profile.get(front) or {}, profile.get("server_cpu_ms_per_request", {})
    rows = {"waiting in Triton's queue": figures["queue_ms_per_request"], "execute (Triton's compute time of its batch)":
            figures["execute_ms"], "(requests per execution)": figures["mean_batch"]} if figures.get("requests") else {}
    return {**rows, "CPU: tritonserver": cpu.get("tritonserver", 0.0), "CPU: front stub": cpu.get(f"stub {front}", 0.0),
            "CPU: decoder stub": cpu.get("stub mimi_decoder", 0.0),
            "CPU: load generator": profile.get("load_cpu_ms_per_request", 0.0)}


def front_markdown(results: dict) -> str:
    lines = ["Local tritonserver 2.51, the null decoder; code2wav and the minimal front (one async_exec per "
             "request) served side by side with as many instances each; client and server on the same cores.", "",
             f"Throughput: {results['unpaced']} unpaced conversations of 1-frame requests, {results['seconds']:g} s per "
             f"measurement, the two fronts in turn for {results['rounds']} rounds.", "",
             "| front instances | code2wav requests/s | minimal front requests/s | code2wav / minimal (median) |",
             "|---:|---:|---:|---:|"]
    lines += [md_row(point["instances"], *(f"{statistics.median(point['rps'][front]):.0f}" for front in FRONTS),
                     f"{point['ratio']:.2f}") for point in results["points"]]
    lines += ["", f"Live: {results['conversations']} per-frame conversations ticking every 80 ms, "
              f"{results['seconds']:g} s; a miss is a frame more than {results['budget_ms']:g} ms late.", "",
              "| front instances | front | late p50 / p99 ms | misses | server CPU ms / request | cores busy |",
              "|---:|---|---:|---:|---:|---:|"]
    lines += [md_row(point["instances"], front, "{p50:.0f} / {p99:.0f}".format(**live["result"]["late_ms"]),
                     live["result"]["misses"],
                     f"{live['profile'].get('server_cpu_ms_per_request_total', float('nan')):.3f}",
                     f"{live['profile'].get('server_cpu_cores_busy') or float('nan'):.2f}")
              for point in results["points"] for front, live in point["live"].items()]
    # Host sizing: a per-frame conversation sends a request per 80 ms frame; one front instance's process uses a
    # core at most (its GIL).
    lines += ["", "Sizing from the live code2wav runs (server CPU only; the null decoder, so the decoder's own "
              "cost comes on top; rerun on the serving host):", "",
              "| front instances | server CPU ms / request | per-frame conversations per server core | "
              "front stub CPU ms / request | per-frame conversations one front instance carries at most |",
              "|---:|---:|---:|---:|---:|"]
    for point in results["points"]:
        profile = point["live"]["code2wav"]["profile"]
        server_ms = profile.get("server_cpu_ms_per_request_total")
        stub_ms = profile.get("server_cpu_ms_per_request", {}).get("stub code2wav")
        if server_ms and stub_ms:  # the stubs' CPU per request, whichever instance served it
            lines.append(md_row(point["instances"], f"{server_ms:.3f}", f"{FRAME_DURATION_S * 1000 / server_ms:.0f}",
                                f"{stub_ms:.3f}", f"{FRAME_DURATION_S * 1000 / stub_ms:.0f}"))
    lines += ["", "Cores for N per-frame conversations: N x 12.5 requests/s x the server CPU per request; front "
              "instances: N over the last column, at least."]
    for point in results["points"]:
        lines += ["", f"Where a live request's time and CPU go, {point['instances']} front instance(s):", "",
                  "| | code2wav ms / request | minimal front ms / request |", "|---|---:|---:|"]
        code2wav_rows, minimal_rows = (breakdown(point, front) for front in FRONTS)
        lines += [md_row(what, *("" if rows.get(what) is None else f"{rows[what]:.3f}" for rows in (code2wav_rows, minimal_rows)))
                  for what in dict.fromkeys([*code2wav_rows, *minimal_rows])]
    return "\n".join(lines)
