"""One point of the Triton sweep, and what all its points share."""

from __future__ import annotations

from dataclasses import dataclass

from mimi_code2wav.client.stream import FRAME_DURATION_S

FRAMES_PER_S_REAL_TIME = 1 / FRAME_DURATION_S  # 12.5 frames/s per live stream
PACED_KEEPS_REAL_TIME = 0.99  # slowest stream's RTF: paced streams cannot exceed 1, jitter costs ~1%


@dataclass(frozen=True)
class SweepLoad:
    """What every point of a sweep sends: streams of `frames` frames of random codes (stream i seeded
    `seed + i`), each perf_analyzer point lasting about `point_seconds`."""

    frames: int
    seed: int
    point_seconds: float


@dataclass(frozen=True)
class SweepPoint:
    """`streams` concurrent streams, `chunk_frames` frames per request after the first. Unpaced: each
    stream sends its next request when the last returned. Paced: each request leaves when its frame
    would exist; with `catch_up`, one request in flight per stream, carrying every frame since the last."""

    streams: int
    chunk_frames: int
    paced: bool = False
    catch_up: bool = False

    @property
    def label(self) -> str:
        if self.paced:
            return f"{self.streams} paced live stream(s)" + (", catching up" if self.catch_up else "")
        return f"{self.streams} stream(s) unpaced, {self.chunk_frames} frame(s) per request"

    def row(self) -> dict:
        """The point's fields as they head its result row."""
        fields = {"streams": self.streams, "paced": self.paced, "chunk_frames": self.chunk_frames}
        return {**fields, "catch_up": self.catch_up} if self.paced else fields
