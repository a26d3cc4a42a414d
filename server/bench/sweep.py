"""The Triton sweep: its points in order, each measured and profiled, a crashed local server restarted."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from mimi_code2wav.client.stream import Code2WavStreamer, StreamOptions, random_codes

from .client import run_client_point
from .local_server import LocalServer
from .perf import run_perf_point
from .points import PACED_KEEPS_REAL_TIME, SweepLoad, SweepPoint
from .profile import PointProfile, settle_gc


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Sweep:
    """The points of one run against one server (`url`, or the `local` server it started); rows go
    to `client` and `perf`, failed points are counted in `failures`."""

    def __init__(self, load: SweepLoad, raw_dir: Path, url: str | None = None, local: LocalServer | None = None):
        self.load, self.raw_dir, self._url, self.local = load, raw_dir, url, local
        self.client: list[dict] = []
        self.perf: list[dict] = []
        self.failures = 0

    @property
    def url(self) -> str:
        return self._url or self.local.url

    def server_alive(self) -> bool:
        return self.local is None or self.local.server.is_alive()

    def warm_up(self, chunk_frames: list[int]) -> None:
        """The first requests of a fresh server pay one-off set-up costs: they are not measured."""
        with Code2WavStreamer(self.url) as streamer:
            streamer.check_ready()
            for chunk in chunk_frames:
                streamer.run([random_codes(2 * chunk + 1, self.load.seed)], StreamOptions(chunk_frames=chunk))

    def measure(self, point: SweepPoint, run: Callable[[str], dict]) -> dict:
        """One point, profiled. A local server that dies during it is restarted and the point
        measured once more; the row records the crash (a second crash leaves the error)."""
        for attempt in (1, 2):
            settle_gc()
            profile = self.local.profile() if self.local is not None else PointProfile(None, None)
            profile.start()
            try:
                row = run(self.url)
            except Exception as exc:  # a dying server also fails the client's gRPC stream itself
                row = {"error": f"{type(exc).__name__}: {exc}"}
            if not self.server_alive():
                why = self.local.restart()
                _log(f"{point.label}: {why}\nrestarted the server")
                if attempt == 1:
                    continue
                row.setdefault("error", "the server crashed twice")
            if "error" not in row:
                row["profile"] = profile.finish(row.get("requests", 0))
            if attempt == 2:
                row["after_server_crash"] = True
            row = {**point.row(), **row}
            self.failures += "error" in row
            return row

    def unpaced(self, point: SweepPoint, client: bool, perf: bool) -> None:
        """The point with the streaming client, then with perf_analyzer (its length sized by the
        client's request rate when the client ran)."""
        request_rate_estimate = None
        if client:
            _log(f"client        {point.label} ...")
            row = self.measure(point, lambda url: run_client_point(url, point, self.load))
            request_rate_estimate = row.get("requests_per_s")
            self.client.append(row)
        if perf:
            _log(f"perf_analyzer {point.label} ...")
            self.perf.append(self.measure(point, lambda url: run_perf_point(
                url, point, self.load, request_rate_estimate, self.raw_dir, self.server_alive)))

    def paced(self, streams: list[int], catch_up: bool) -> None:
        """Paced live streams, more each time, until one stream falls behind real time."""
        for count in streams:
            point = SweepPoint(count, 1, paced=True, catch_up=catch_up)
            _log(f"client        {point.label} ...")
            row = self.measure(point, lambda url, point=point: run_client_point(url, point, self.load))
            self.client.append(row)
            if "error" in row or row["real_time_factor_per_stream_min"] < PACED_KEEPS_REAL_TIME:
                break  # more streams fall further behind
