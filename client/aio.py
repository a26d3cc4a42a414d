"""The asyncio client: many conversations on one event loop, one gRPC channel per server. Calls made while a
stream's request is out wait in order (at most `max_pending_calls`) and go as one request (at most
`COALESCE_MAX_FRAMES`); a cancelled `decode` (`asyncio.wait_for`, barge-in) leaves its frames owed to the next."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

import numpy as np

from . import protocol
from .credentials import PLAINTEXT, Credentials
from .plan import PlannedClient, PlannedRequest, PlannedStream
from .protocol import DEFAULT_OPTIONS, DEFAULT_URL, HISTORY_FRAMES_INPUT, SAMPLES_PER_FRAME, ClientError, StreamOptions

DEFAULT_MAX_PENDING_CALLS = 16
COALESCE_MAX_FRAMES = 50  # frames that waiting calls are merged into, at most (4 s); a longer call goes alone


@dataclasses.dataclass(eq=False)
class _Call:
    """One `decode` call: its frames [first, stop) of the stream, and the future of their PCM."""
    first: int
    stop: int
    end: bool
    answer: asyncio.Future


class Code2WavStream(PlannedStream):
    """One conversation of a `Code2WavClient`: `await decode(codes)`, then `await close()` ENDs it."""

    def __init__(self, client: Code2WavClient, sequence_id: int | None, stream_key: str | None):
        super().__init__(client, sequence_id, stream_key)
        self._turn = asyncio.Lock()  # held by the call whose request is in flight; FIFO: calls stay in order
        self._queue: list[_Call] = []  # calls not answered yet, in call order

    async def __aenter__(self) -> Code2WavStream:
        return self

    async def __aexit__(self, exc_type, *exc_info) -> None:
        if exc_type is None:
            await self.close()

    async def decode(self, codes: np.ndarray, end: bool = False) -> np.ndarray:
        """PCM float32 [F * 1920] of the stream's next frames, codes [8, F], the last ones with `end`."""
        limit = self._client.max_pending_calls
        if len(self._queue) > limit:
            raise ClientError(f"stream {self.stream_key}: {len(self._queue) - 1} calls already wait behind "
                              f"the request in flight (max_pending_calls={limit})")
        call = _Call(*self._plan.hand(codes, end), end, asyncio.get_running_loop().create_future())
        self._queue.append(call)
        try:
            async with self._turn:
                if not call.answer.done():
                    await self._send_queued()
            return call.answer.result()
        finally:
            if call in self._queue:  # cancelled before its answer: its frames stay owed
                self._queue.remove(call)
            if call.answer.done() and not call.answer.cancelled():
                call.answer.exception()  # retrieved: an abandoned call's error is not "never retrieved"

    async def close(self) -> None:
        """END the stream (with the frames still owed) after the waiting calls, if the server holds it."""
        async with self._turn:
            if self._plan.needs_end:
                handed = self._plan.handed_frames
                await self._exchange(handed, handed, True)

    async def _send_queued(self) -> None:
        """One request for the queued calls (the first, then up to COALESCE_MAX_FRAMES): each gets its PCM or error."""
        batch, frames = [], 0
        for call in self._queue:
            if batch and frames + call.stop - call.first > COALESCE_MAX_FRAMES:
                break
            batch.append(call)
            frames += call.stop - call.first
        first = batch[0].first
        try:
            pcm = await self._exchange(first, batch[-1].stop, batch[-1].end)
        except ClientError as error:
            answers = [error] * len(batch)
        else:
            answers = [pcm[(call.first - first) * SAMPLES_PER_FRAME : (call.stop - first) * SAMPLES_PER_FRAME]
                       for call in batch]
        for call, answer in zip(batch, answers):
            if call in self._queue:
                self._queue.remove(call)
            if not call.answer.done():
                (call.answer.set_exception if isinstance(answer, ClientError) else call.answer.set_result)(answer)

    async def _exchange(self, first: int, stop: int, end: bool) -> np.ndarray:
        """Drive `StreamPlan.exchange`; a cancelled call abandons it, leaving its frames owed."""
        steps, outcome = self._plan.exchange(first, stop, end), None
        while True:
            try:
                step = steps.send(outcome)
            except StopIteration as done:
                return done.value
            outcome = await (self._client._infer(self, step) if isinstance(step, PlannedRequest) else asyncio.sleep(step))


class Code2WavClient(PlannedClient):
    """Streams from one event loop, each request with `frame_offset`; channels open on first use, close on `close()`."""

    stream_type = Code2WavStream

    def __init__(self, urls: str | Sequence[str] = DEFAULT_URL, options: StreamOptions = DEFAULT_OPTIONS,
                 max_pending_calls: int = DEFAULT_MAX_PENDING_CALLS, credentials: Credentials = PLAINTEXT):
        super().__init__(urls, options, credentials)
        if not options.send_frame_offset:
            raise ClientError("the asyncio client sends frame_offset with every request (send_frame_offset=True)")
        if max_pending_calls < 0:
            raise ClientError(f"max_pending_calls must be >= 0, got {max_pending_calls}")
        self.max_pending_calls = max_pending_calls
        self._channels: dict = {}

    async def __aenter__(self) -> Code2WavClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channels. Streams not ENDed are dropped by the server after its idle timeout."""
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()

    async def check_ready(self, timeout_s: float = 10.0) -> None:
        """Raise ClientError (one line) unless every URL answers, takes this client's TLS and key, and its
        model is ready, with the `history_frames` input a resume needs."""
        from tritonclient.utils import InferenceServerException

        name = self.options.model_name
        for url in self.urls:
            channel = self._channel(url)
            try:
                live = await channel.is_server_live(client_timeout=timeout_s)
            except InferenceServerException as exc:
                raise protocol.unreachable(url, exc, self.credentials.connection_hint(str(exc))) from None
            if not live:
                raise ClientError(f"Triton at {url} answers but is not live")
            try:
                ready = await channel.is_model_ready(name, client_timeout=timeout_s)
            except InferenceServerException as exc:
                raise ClientError(f"Triton at {url}: readiness of model '{name}' unknown: "
                                  f"{protocol.grpc_reason(exc)}") from None
            if not ready:
                try:  # the index only decorates the message
                    models = (await channel.get_model_repository_index(as_json=True)).get("models", [])
                    model = next((model for model in models if model.get("name") == name), {})
                    reason = f": {model['reason']}" if model.get("reason") else ""
                    state = f"state {model.get('state', 'UNKNOWN')}{reason}" if model else "not in the model repository"
                except Exception:
                    state = "state unknown"
                raise ClientError(f"model '{name}' is not ready on Triton at {url} ({state}); see the server log")
            try:  # metadata, unlike health, is behind the inference key where the server requires one
                metadata = await channel.get_model_metadata(name, headers=self.credentials.headers(), as_json=True,
                                                            client_timeout=timeout_s)
            except InferenceServerException as exc:
                if protocol.RESTRICTED_FRAGMENT in str(exc):
                    raise ClientError(self.credentials.key_refused(url)) from None
                raise ClientError(f"Triton at {url}: metadata of model '{name}' unavailable: "
                                  f"{protocol.grpc_reason(exc)}") from None
            if self.options.resume and HISTORY_FRAMES_INPUT not in {t.get("name") for t in metadata.get("inputs", [])}:
                raise ClientError(f"model '{name}' on Triton at {url} has no '{HISTORY_FRAMES_INPUT}' input, which "
                                  "resuming a stream needs: serve this version's model repository, or turn resume off")

    def _channel(self, url: str):
        if url not in self._channels:
            import tritonclient.grpc.aio as grpcclient

            self._channels[url] = grpcclient.InferenceServerClient(
                url, channel_args=list(protocol.CHANNEL_ARGS), creds=self.credentials.channel_credentials())
        return self._channels[url]

    async def _infer(self, stream: Code2WavStream, request: PlannedRequest):
        """The InferResult, or the RequestFailure."""
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.utils import InferenceServerException

        try:
            return await self._channel(stream.url).infer(**stream._infer_args(grpcclient, request))
        except InferenceServerException as exc:
            return protocol.request_failure(exc)
