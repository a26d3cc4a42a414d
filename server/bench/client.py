"""Driving the streaming client (client.stream) for one sweep point."""

from __future__ import annotations

import numpy as np

from mimi_code2wav.client.stream import Code2WavStreamer, StreamOptions, random_codes

from .points import SweepLoad, SweepPoint


def run_client_point(url: str, point: SweepPoint, load: SweepLoad) -> dict:
    """The point's streams through `Code2WavStreamer`: latency, real-time factor, throughput."""
    codes = [random_codes(load.frames, load.seed + i) for i in range(point.streams)]
    options = StreamOptions(chunk_frames=point.chunk_frames, paced=point.paced, catch_up=point.catch_up)
    with Code2WavStreamer(url) as streamer:
        report = streamer.run(codes, options)
    stats = report.summary()
    sizes = [frames for result in report.results for frames in result.chunk_frames]
    return {
        "streams": point.streams, "paced": point.paced, "catch_up": point.catch_up, "chunk_frames": point.chunk_frames,
        "frames_per_request_mean": float(np.mean(sizes)),
        "first_chunk_ms": stats["first_chunk_latency_ms_mean"],
        "first_chunk_ms_max": stats["first_chunk_latency_ms_max"],
        "p50_ms": stats["chunk_latency_ms_p50"], "p90_ms": stats["chunk_latency_ms_p90"],
        "p99_ms": stats["chunk_latency_ms_p99"],
        "real_time_factor": stats["real_time_factor"],
        "real_time_factor_per_stream_min": stats["real_time_factor_per_stream_min"],
        "frames_per_s": stats["frames_per_s"],
        "requests_per_s": stats["requests"] / stats["wall_s"], "requests": stats["requests"],
    }
