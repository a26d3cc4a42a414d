"""What a run of streams reports: each stream's PCM, latencies and resumes; the CLI's and benchmarks' summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .plan import Resume
from .protocol import FRAME_DURATION_S, StreamOptions


def percentiles(values, points: Sequence[int] = (50, 99), empty=None) -> dict:
    """{"p50": ..., "p99": ..., "max": ...} of `values`, or `empty` for each when there are none."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {**{f"p{point}": empty for point in points}, "max": empty}
    return {**{f"p{point}": float(np.percentile(values, point)) for point in points}, "max": float(values.max())}


def _per_wall_s(amount: float, wall_s: float) -> float:
    return amount / wall_s if wall_s > 0 else float("inf")


@dataclass
class StreamResult:
    """One decoded stream. Times are time.perf_counter() seconds."""

    sequence_id: int
    frames: int
    pcm: np.ndarray  # float32 [frames * 1920]
    chunk_frames: list[int]  # new frames of each request
    chunk_latencies_s: list[float]  # send -> response, per request
    started_s: float  # first request sent
    finished_s: float  # last response received
    resumes: list[Resume] = field(default_factory=list)
    stream_key: str | None = None  # the STREAM_KEY_HEADER value
    chunk_sent_s: list[float] = field(default_factory=list)  # when each request was sent

    audio_s = property(lambda self: self.frames * FRAME_DURATION_S)
    wall_s = property(lambda self: self.finished_s - self.started_s)
    real_time_factor = property(lambda self: _per_wall_s(self.audio_s, self.wall_s))  # > 1: faster than real time


@dataclass
class RunReport:
    """All streams of one run; `wall_s`: first request of any stream -> last response of any stream."""

    results: list[StreamResult]
    options: StreamOptions
    wall_s: float

    def summary(self) -> dict:
        """Latencies in ms: first-chunk latency over streams, chunk percentiles over all requests."""
        latencies_ms = np.array([x for r in self.results for x in r.chunk_latencies_s]) * 1e3
        first_ms = np.array([r.chunk_latencies_s[0] for r in self.results]) * 1e3
        audio_s = sum(r.audio_s for r in self.results)
        return {
            "streams": len(self.results),
            "frames_per_stream": self.results[0].frames if self.results else 0,
            "requests": int(latencies_ms.size),
            "first_chunk_latency_ms_mean": float(first_ms.mean()),
            "first_chunk_latency_ms_max": float(first_ms.max()),
            **{f"chunk_latency_ms_{key}": value
               for key, value in percentiles(latencies_ms, (50, 90, 99)).items() if key != "max"},
            "audio_s": audio_s,
            "wall_s": self.wall_s,
            "real_time_factor": _per_wall_s(audio_s, self.wall_s),
            "real_time_factor_per_stream_min": float(min(r.real_time_factor for r in self.results)),
            "frames_per_s": _per_wall_s(sum(r.frames for r in self.results), self.wall_s),
            "resumes": sum(len(r.resumes) for r in self.results),
        }
