"""What a run of streams reports: each stream's PCM, request latencies and resumes, and the summary
the CLI and the benchmarks print."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .plan import Resume
from .protocol import FRAME_DURATION_S, StreamOptions


def percentiles(values, points: Sequence[int] = (50, 99), empty=None) -> dict:
    """{"p50": ..., "p99": ..., "max": ...} of `values` (each of `points`, then the largest), or `empty`
    for each when there are none: the one summary of latencies the CLI and the benchmarks print."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {**{f"p{point}": empty for point in points}, "max": empty}
    return {**{f"p{point}": float(np.percentile(values, point)) for point in points}, "max": float(values.max())}


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
    resumes: list[Resume] = field(default_factory=list)  # resumable streams: each resume, in order
    stream_key: str | None = None  # resumable streams: the STREAM_KEY_HEADER value
    chunk_sent_s: list[float] = field(default_factory=list)  # resumable streams: when each request was sent

    @property
    def first_chunk_latency_s(self) -> float:
        return self.chunk_latencies_s[0]

    @property
    def audio_s(self) -> float:
        return self.frames * FRAME_DURATION_S

    @property
    def wall_s(self) -> float:
        return self.finished_s - self.started_s

    @property
    def real_time_factor(self) -> float:
        """Audio seconds per wall second (> 1: faster than real time)."""
        return self.audio_s / self.wall_s if self.wall_s > 0 else float("inf")


@dataclass
class RunReport:
    """All streams of one run, and the statistics a summary shows."""

    results: list[StreamResult]
    options: StreamOptions
    wall_s: float  # first request of any stream -> last response of any stream
    extra: dict = field(default_factory=dict)

    @property
    def audio_s(self) -> float:
        return sum(r.audio_s for r in self.results)

    @property
    def frames(self) -> int:
        return sum(r.frames for r in self.results)

    @property
    def real_time_factor(self) -> float:
        """Total audio seconds of all streams per wall second of the run."""
        return self.audio_s / self.wall_s if self.wall_s > 0 else float("inf")

    def summary(self) -> dict:
        """Latencies in milliseconds; first-chunk latency over streams, chunk percentiles over all requests."""
        latencies_ms = np.array([x for r in self.results for x in r.chunk_latencies_s]) * 1e3
        first_ms = np.array([r.first_chunk_latency_s for r in self.results]) * 1e3
        return {
            "streams": len(self.results),
            "paced": self.options.paced,
            "mode": self.options.mode,
            "chunk_frames": self.options.chunk_frames,
            "frames_per_stream": self.results[0].frames if self.results else 0,
            "requests": int(latencies_ms.size),
            "first_chunk_latency_ms_mean": float(first_ms.mean()),
            "first_chunk_latency_ms_max": float(first_ms.max()),
            **{f"chunk_latency_ms_{key}": value
               for key, value in percentiles(latencies_ms, (50, 90, 99)).items() if key != "max"},
            "audio_s": self.audio_s,
            "wall_s": self.wall_s,
            "real_time_factor": self.real_time_factor,
            "real_time_factor_per_stream_min": float(min(r.real_time_factor for r in self.results)),
            "frames_per_s": self.frames / self.wall_s if self.wall_s > 0 else float("inf"),
            "resumes": sum(len(r.resumes) for r in self.results),
        }
