"""`TritonPersonaPlexCode2Wav`: vLLM-Omni's PersonaPlex codec stage, decoded by the code2wav service (docs/design.md
§2.5). Each request id is one stream (its key), a `forward`'s requests go together, `on_requests_finished` ENDs their
streams, a failed request raises once the others are answered, warm-up requests are answered empty without a call."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm_omni.model_executor.models.output_templates import OmniOutput
from vllm_omni.model_executor.models.personaplex.personaplex_code2wav import (
    PersonaPlexCode2Wav,
    _codec_ids_from_payload_or_input,
)

from mimi_code2wav.client import protocol
from mimi_code2wav.client.aio import Code2WavClient, Code2WavStream
from mimi_code2wav.client.credentials import Credentials
from mimi_code2wav.client.protocol import NUM_CODEBOOKS, SAMPLE_RATE_HZ, SAMPLES_PER_FRAME, ClientError, StreamOptions

logger = init_logger(__name__)

CONFIG_KEY = "code2wav"  # additional_config: {code2wav: {url: ..., ...}}
ENV_PREFIX = "CODE2WAV_"
_BOOLEANS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off", ""), False)}
# The stage's settings and their defaults: `url` one server or proxy, or several (comma-separated) to fail
# over between; the client's StreamOptions; its Credentials (the key from `key_file`, else CODE2WAV_KEY).
SETTINGS = {"url": protocol.DEFAULT_URL, "model": protocol.MODEL_NAME, "response_timeout_s": 10.0,
            "resume_timeout_s": protocol.DEFAULT_RESUME_TIMEOUT_S,
            "resume_history_frames": protocol.DEFAULT_RESUME_HISTORY_FRAMES, "tls": False, "tls_ca": "", "tls_cert": "", "tls_key": "", "key_file": ""}


def plugin_settings(stage_config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """Each setting from the stage config, else from CODE2WAV_<NAME> in the environment, else its default.
    Unknown config keys and unparsable values are errors naming them."""
    stage_config, settings = dict(stage_config or {}), dict(SETTINGS)
    unknown = sorted(set(stage_config) - set(SETTINGS))
    if unknown:
        raise ValueError(f"additional_config.{CONFIG_KEY}: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(SETTINGS)})")
    for name, default in SETTINGS.items():
        source, raw = f"additional_config.{CONFIG_KEY}.{name}", stage_config.get(name)
        if raw is None:
            source, raw = ENV_PREFIX + name.upper(), environ.get(ENV_PREFIX + name.upper())
        parse = (lambda raw: _BOOLEANS[str(raw).strip().lower()]) if isinstance(default, bool) else type(default)
        if raw is not None:
            try:
                settings[name] = parse(raw)
            except (TypeError, ValueError, KeyError):
                raise ValueError(f"{source}: not a {type(default).__name__}: {raw!r}") from None
    return settings


class TritonPersonaPlexCode2Wav(PersonaPlexCode2Wav):
    """PersonaPlex's code2wav stage as a client of the code2wav Triton service (see the module)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        # Not the seed's __init__ (it loads Mimi): only the attributes the runner and inherited helpers read.
        nn.Module.__init__(self)
        self.vllm_config, self.mimi = vllm_config, None
        self.model_path = getattr(vllm_config.model_config, "model", None)
        self.config = getattr(vllm_config.model_config, "hf_config", None)
        self.have_multimodal_outputs = self.enable_update_additional_information = self.requires_raw_input_tokens = True
        self.has_preprocess = self.has_postprocess = False
        mimi_config = getattr(self.config, "mimi_config", None)
        served = {"num_codebooks": NUM_CODEBOOKS, "samples_per_frame": SAMPLES_PER_FRAME, "sample_rate": SAMPLE_RATE_HZ}
        asked = {name: int(getattr(mimi_config, name, value)) for name, value in served.items()}
        if asked != served:
            raise ValueError(f"the code2wav service decodes {served}; this model's Mimi config asks for {asked}")
        settings = self.settings = plugin_settings((vllm_config.additional_config or {}).get(CONFIG_KEY), os.environ)
        urls = [url.strip() for url in settings["url"].split(",") if url.strip()]
        options = StreamOptions(model_name=settings["model"], **{name: settings[name] for name in (
            "response_timeout_s", "resume_timeout_s", "resume_history_frames")})
        try:  # errors name what is wrong, never the key
            credentials = Credentials.from_options(settings["tls"], settings["tls_ca"], settings["tls_cert"],
                                                   settings["tls_key"], settings["key_file"], environ=dict(os.environ))
            self._client = Code2WavClient(urls, options, credentials=credentials)
        except ClientError as error:
            raise ValueError(f"additional_config.{CONFIG_KEY}: {error}") from None
        self._streams: dict[str, Code2WavStream] = {}
        # The client's event loop, in a thread of its own: `forward` hands it coroutines and waits.
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="code2wav-client", daemon=True).start()
        logger.info("PersonaPlex code2wav stage decoded by the code2wav service at %s (model %s)",
                    ", ".join(urls), settings["model"])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Nothing to load: the service holds Mimi. The stage's checkpoint iterator is left unread."""
        return set()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                runtime_additional_information: list[dict[str, Any]] | None = None, **kwargs: Any) -> OmniOutput:
        """Each request's new frames [k * F] (codebook-major) -> its PCM, float32 [F * 1920], and `sr`."""
        sr = torch.tensor(SAMPLE_RATE_HZ, dtype=torch.int32)
        empty = torch.zeros((0,), dtype=torch.float32)
        if input_ids is None or input_ids.numel() == 0:
            return OmniOutput(text_hidden_states=None, multimodal_outputs={"model_outputs": [empty], "sr": [sr]})
        segments = self._split_request_ids(input_ids.reshape(-1).to(dtype=torch.long), kwargs.get("seq_token_counts"))
        request_ids = self._resolve_request_ids(len(segments), kwargs.get("request_ids"),
                                                runtime_additional_information)
        infos = runtime_additional_information or []
        work: list[tuple[int, str | None, np.ndarray]] = []
        for index, segment in enumerate(segments):
            info = infos[index] if index < len(infos) else None
            meta = info.get("meta") if isinstance(info, Mapping) else None
            if isinstance(meta, Mapping) and meta.get("personaplex_dummy_profile") is True:
                continue
            flat = _codec_ids_from_payload_or_input(segment, info)
            if flat.numel() == 0 or flat.numel() % NUM_CODEBOOKS:
                if flat.numel() > 1:  # a single placeholder token marks a segment boundary
                    logger.warning("request %s: %d codes are not a multiple of %d codebooks; skipped",
                                   request_ids[index], flat.numel(), NUM_CODEBOOKS)
                continue
            work.append((index, request_ids[index], flat.reshape(NUM_CODEBOOKS, -1).cpu().numpy()))
        audio = [empty] * len(segments)
        if work:
            decoded = asyncio.run_coroutine_threadsafe(self._decode_all(work), self._loop).result()
            for (index, _, _), pcm in zip(work, decoded):
                audio[index] = torch.from_numpy(np.array(pcm, dtype=np.float32))  # its own, writable
        return OmniOutput(text_hidden_states=None,
                          multimodal_outputs={"model_outputs": audio, "sr": [sr] * len(segments)})

    async def _decode_all(self, work: list[tuple[int, str | None, np.ndarray]]) -> list[np.ndarray]:
        """Every request's frames sent at once; once all are answered, raises naming each that failed."""
        results = await asyncio.gather(*(self._decode(request_id, codes) for _, request_id, codes in work),
                                       return_exceptions=True)
        failures = [f"request {request_id}: {result}" for (_, request_id, _), result in zip(work, results)
                    if isinstance(result, BaseException)]
        if failures:
            raise RuntimeError(f"the code2wav service at {self.settings['url']} could not decode: {'; '.join(failures)}")
        return results

    async def _decode(self, request_id: str | None, codes: np.ndarray) -> np.ndarray:
        if request_id is None:  # no id to continue it by: a stream of one request
            async with self._client.stream() as stream:
                return await stream.decode(codes, end=True)
        stream = self._streams.get(request_id)
        if stream is None:
            stream = self._streams[request_id] = self._client.stream(stream_key=request_id)
        try:
            return await stream.decode(codes)
        except ClientError:
            self._streams.pop(request_id, None)  # its state is gone: a later call starts afresh
            raise

    def on_requests_finished(self, finished_req_ids: set[str] | list[str]) -> None:
        """END the streams of finished requests; the runner does not wait for the answers."""
        streams = [s for s in (self._streams.pop(str(rid), None) for rid in finished_req_ids) if s is not None]
        if streams:
            asyncio.run_coroutine_threadsafe(self._close(streams), self._loop)

    async def _close(self, streams: list[Code2WavStream]) -> None:
        for stream, outcome in zip(streams, await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)):
            if isinstance(outcome, BaseException):  # the server drops it after its idle timeout
                logger.warning("code2wav stream %s: END failed: %s", stream.stream_key, outcome)
