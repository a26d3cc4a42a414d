"""Unit tests of code2wav's pure core (model_repository/code2wav/1/code2wav_*.py; no server).

A fake decoder stands in for mimi_decoder: it records every step (stream, codes, flags) and returns
PCM whose samples encode the frame they came from, so the tests can check exactly which frames were
decoded, in which order, with which flags, and where their audio landed in the output.
"""

import asyncio

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLES_PER_FRAME

from helpers import MODEL_REPOSITORY, FakeClock, load_model_module, triton_model_config

MODEL_DIR = MODEL_REPOSITORY / "code2wav" / "1"

# Each name from the file that defines it (the sibling files import one another by module name).
core = load_model_module(MODEL_DIR / "code2wav_core.py")
code2wav_settings = load_model_module(MODEL_DIR / "code2wav_settings.py")
code2wav_plan = load_model_module(MODEL_DIR / "code2wav_plan.py")
code2wav_replay = load_model_module(MODEL_DIR / "code2wav_replay.py")
code2wav_stream = load_model_module(MODEL_DIR / "code2wav_stream.py")
model_errors = load_model_module(MODEL_REPOSITORY / "common" / "model_errors.py")

START = code2wav_settings.FLAG_SEQUENCE_START
END = code2wav_settings.FLAG_SEQUENCE_END
StreamRequest = code2wav_plan.StreamRequest
DecoderError = code2wav_settings.DecoderError
RequestError = code2wav_settings.RequestError
StreamCapError = code2wav_settings.StreamCapError
SAMPLES = 4  # samples per frame in most tests: small, so outputs are easy to read


# ---- helpers -----------------------------------------------------------------------------------------

def make_codes(frames, seed=0):
    """Random codes [k, frames] whose frames are all distinct (codebook 0 holds the frame index).
    Drawn frame by frame, so make_codes(n, seed) is a prefix of make_codes(n + m, seed)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, CODEBOOK_SIZE, size=(frames, NUM_CODEBOOKS), dtype=np.int64).T.copy()
    codes[0] = (np.arange(frames) + 7 * seed) % CODEBOOK_SIZE
    return codes


def silence(frames):
    """`frames` identical frames (what a listening duplex model emits)."""
    return np.full((NUM_CODEBOOKS, frames), 5, np.int64)


def changed_at(codes, frame, codebook=0):
    """A copy of codes [k, F] whose `frame` differs in one code."""
    codes = codes.copy()
    codes[codebook, frame] = (codes[codebook, frame] + 1) % CODEBOOK_SIZE
    return codes


A = make_codes(9)  # one stream's frames, for the tables below
NO_FRAMES = np.zeros((NUM_CODEBOOKS, 0), np.int64)


def flat(codes):
    """codes [k, F] -> input_ids INT64 [1, k*F], codebook-major."""
    return np.ascontiguousarray(codes, dtype=np.int64).reshape(1, -1)


def offset(value):
    """An optional scalar input: an int as INT64 [1, 1]; None or an array as it is."""
    return value if value is None or isinstance(value, np.ndarray) else np.array([[value]], dtype=np.int64)


def expected_pcm(codes, samples_per_frame=SAMPLES):
    """The fake decoder's PCM of codes [k, F]: [1, F * samples_per_frame], one value per frame naming it."""
    codes = np.asarray(codes, dtype=np.float64)
    signature = (codes[0] + codes[1] / 4096.0 + codes[2] / 4096.0**2).astype(np.float32)
    return np.repeat(signature, samples_per_frame)[None, :]


class FakeDecoder:
    """Async stand-in for the BLS helper: records every step and returns its expected_pcm. The call
    numbered `fail_on_call` (from 1) raises `error`, `wrong_size_on_call` returns a sample short;
    steps of the streams in `gated` wait until `gate` is set (a long request still decoding)."""

    def __init__(self, samples_per_frame=SAMPLES, fail_on_call=None, error=None, wrong_size_on_call=None, gated=()):
        self.samples_per_frame = samples_per_frame
        self.fail_on_call, self.wrong_size_on_call = fail_on_call, wrong_size_on_call
        self.error = DecoderError("simulated decoder failure") if error is None else error
        self.gated, self.gate = set(gated), asyncio.Event()
        self.calls = []  # (correlation_id, codes int32 [1, k, S], flags)
        self.events = []  # ("begin"/"end", correlation_id) in execution order
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, correlation_id, codes, flags):
        if correlation_id in self.gated:
            await self.gate.wait()
        assert codes.dtype == np.int32 and codes.ndim == 3 and codes.shape[:2] == (1, NUM_CODEBOOKS)
        assert codes.flags.c_contiguous
        self.calls.append((correlation_id, codes.copy(), flags))
        call_number = len(self.calls)
        self.events.append(("begin", correlation_id))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # let other streams' steps start
            if call_number == self.fail_on_call:
                raise self.error
            pcm = expected_pcm(codes[0], self.samples_per_frame)
            return pcm[:, :-1] if call_number == self.wrong_size_on_call else pcm
        finally:
            self.in_flight -= 1
            self.events.append(("end", correlation_id))

    def flags(self):
        return [flags for _, _, flags in self.calls]

    def sizes(self):
        return [codes.shape[2] for _, codes, _ in self.calls]

    def decoded_codes(self, correlation_id=None):
        """The codes of every step (of one stream, if given), concatenated: [k, frames]."""
        chunks = [codes[0] for cid, codes, _ in self.calls if correlation_id in (None, cid)]
        return np.concatenate([np.zeros((NUM_CODEBOOKS, 0), np.int32), *chunks], axis=1)


def make_table(clock=None, **overrides):
    # One frame per decoder call unless a test says otherwise: the step-by-step tests read flags and
    # failures per frame; the multi-frame tests set decoder_max_frames_per_step.
    settings = code2wav_settings.Code2WavSettings(**{"samples_per_frame": SAMPLES, "decoder_max_frames_per_step": 1,
                                                     **overrides})
    return core.StreamTable(settings) if clock is None else core.StreamTable(settings, clock=clock)


# The table's streams and queue have no public reader (they are the table's alone).
def is_live(table, correlation_id):
    return correlation_id in table._streams


def decoded_of(table, correlation_id):
    """A live stream's decoded codes [k, frames] (read-only), from its base (where it was resumed, or 0) on."""
    return table._streams[correlation_id].decoded.codes()


def base_of(table, correlation_id):
    return table._streams[correlation_id].base


def plan_of(table, correlation_id, flags, input_ids, frame_offset=None):
    """What decoding one request takes against the table's stream (`code2wav_plan`); changes nothing."""
    request = StreamRequest(correlation_id, flags, input_ids, frame_offset)
    return code2wav_plan.plan_request(table.settings, table._streams.get(correlation_id), request)


async def process_batch(table, requests, decode_step):
    """One batch through `submit_batch`, waited for: per request, its PCM or the exception it failed with."""
    return list(await asyncio.gather(*table.submit_batch(requests, decode_step)))


def send(table, decoder, correlation_id, flags, codes=None, frame_offset=None, input_ids=None, history_frames=None):
    """Process one request (codes [k, F], or raw input_ids); returns its PCM (or raises its error)."""
    if input_ids is None:
        input_ids = flat(NO_FRAMES if codes is None else codes)
    request = StreamRequest(correlation_id, flags, input_ids, offset(frame_offset), offset(history_frames))
    return asyncio.run(table.process(request, decoder))


def send_error(table, decoder, correlation_id, flags, codes=None, error=RequestError, **inputs):
    with pytest.raises(error) as info:
        send(table, decoder, correlation_id, flags, codes, **inputs)
    return info.value


# ---- settings (the checked-in config: test_code2wav_config.py) ---------------------------------------

def model_config(idle_us=30_000_000, **changes):
    """A model config as Triton hands it to initialize, with the default settings; a change of None
    removes that parameter."""
    settings = code2wav_settings.Code2WavSettings()
    parameters = {name: str(getattr(settings, name)) for name in code2wav_settings.PARAMETER_TYPES}
    return triton_model_config({**parameters, **changes}, idle_us)


def test_parameters_are_parsed_from_strings():
    config = model_config(idle_us="5000000", decoder_model_name="other_decoder", dedupe_mode="delta")
    settings = code2wav_settings.settings_from_config(config)  # the idle timeout in the JSON form of a uint64
    assert (settings.decoder_model_name, settings.dedupe_mode) == ("other_decoder", "delta")
    assert settings.stream_idle_timeout_s == 5.0


IDLE = model_errors.IDLE_TIMEOUT_FIELD


@pytest.mark.parametrize("change, parameter, message", [
    pytest.param({"num_codebooks": None}, "num_codebooks", "missing", id="missing"),
    pytest.param({"dedupe_mod": "auto"}, "dedupe_mod", "unknown parameter", id="unknown"),
    pytest.param({"codebook_size": "2k"}, "codebook_size", "not an integer: '2k'", id="not-int"),
    pytest.param({"samples_per_frame": "0"}, "samples_per_frame", "positive integer", id="zero"),
    pytest.param({"max_request_frames": "-1"}, "max_request_frames", "positive integer", id="negative"),
    pytest.param({"decoder_frames_per_step": "1"}, "decoder_frames_per_step",
                 "unknown parameter (known: decoder_model_name, num_codebooks", id="removed"),
    pytest.param({"dedupe_mode": "both"}, "dedupe_mode", "auto, delta, cumulative", id="mode"),
    pytest.param({"decoder_model_name": " "}, "decoder_model_name", "non-empty", id="name"),
    pytest.param({"idle_us": None}, IDLE, "missing", id="idle-missing"),
    pytest.param({"idle_us": 0}, IDLE, "must be positive", id="idle-zero"),
    pytest.param({"idle_us": "soon"}, IDLE, "not an integer", id="idle-not-int"),
])
def test_bad_parameters_fail_naming_the_parameter(change, parameter, message):
    with pytest.raises(model_errors.ConfigError) as info:
        code2wav_settings.settings_from_config(model_config(**change))
    assert info.value.parameter == parameter
    assert f"'{parameter}'" in str(info.value) and message in str(info.value)


# ---- validation --------------------------------------------------------------------------------------

def code_at(codebook, frame, value):
    codes = make_codes(5)
    codes[codebook, frame] = value
    return codes


MALFORMED = [  # (request fields beside a START of stream 1 with 3 frames, kind, a fragment of the message)
    pytest.param(dict(input_ids=np.zeros((1, 16), np.float32)), "dtype", "input_ids must be INT64, got float32", id="float"),
    pytest.param(dict(input_ids=np.zeros((1, 16), np.int32)), "dtype", "input_ids must be INT64, got int32", id="int32"),
    pytest.param(dict(input_ids=np.zeros((1, 13), np.int64)), "length",
                 "input_ids holds 13 codes, not a multiple of num_codebooks=8", id="length"),
    pytest.param(dict(input_ids=np.zeros((2, 8), np.int64)), "shape",
                 "input_ids must have shape [1, k*F] (one request of flat codes), got [2, 8]", id="batch-2"),
    pytest.param(dict(codes=code_at(0, 0, -1)), "code_range", "input_ids[0] = -1 (codebook 0, frame 0) is outside [0, 2048)",
                 id="code-negative"),
    pytest.param(dict(codes=code_at(3, 2, CODEBOOK_SIZE)), "code_range",
                 "input_ids[17] = 2048 (codebook 3, frame 2) is outside [0, 2048)", id="code-codebook-size"),
    pytest.param(dict(codes=code_at(7, 4, 99999)), "code_range", "input_ids[39] = 99999 (codebook 7, frame 4) is outside "
                 "[0, 2048)", id="code-large"),
    pytest.param(dict(frame_offset=np.array([[0.0]], np.float32)), "dtype", "frame_offset must be INT64, got float32",
                 id="offset-float"),
    pytest.param(dict(frame_offset=np.array([[0, 1]], np.int64)), "shape",
                 "frame_offset must hold one value ([1, 1]), got shape [1, 2]", id="offset-two-values"),
    pytest.param(dict(frame_offset=1), "gap", "frame_offset 1 leaves a gap: stream 1 has decoded 0 frames",
                 id="start-not-at-frame-0"),
    *(pytest.param(dict(correlation_id=cid), "correlation_id", f"got {cid!r}", id=f"correlation-id-{cid}")
      for cid in (0, -3, "abc")),
    pytest.param(dict(correlation_id=42, flags=0), "unknown_stream", "stream 42 is not open: send the first request of "
                 "the sequence with the START flag (a stream ends with END, with a decoder error, or after 12.5 s idle)",
                 id="unknown-stream"),
    pytest.param(dict(flags=0, frame_offset=7, history_frames=2), "unknown_stream", "START", id="history-unknown-stream"),
    pytest.param(dict(frame_offset=5, history_frames=4), "history",
                 "history_frames=4 must lie in [0, 3]: the request holds 3 frames", id="history-more-than-F"),
    pytest.param(dict(frame_offset=5, history_frames=-1), "history", "history_frames=-1 must lie in [0, 3]",
                 id="history-negative"),
    pytest.param(dict(history_frames=2), "history",
                 "history_frames=2 needs frame_offset, the stream index of the request's first frame",
                 id="history-no-offset"),
    pytest.param(dict(frame_offset=0, history_frames=np.array([[2]], np.int32)), "dtype",
                 "history_frames must be INT64, got int32", id="history-int32"),
    pytest.param(dict(frame_offset=0, history_frames=np.array([[1, 2]], np.int64)), "shape",
                 "history_frames must hold one value", id="history-two-values"),
    pytest.param(dict(frame_offset=-2, history_frames=1), "negative_offset", "frame_offset must be >= 0, got -2",
                 id="history-negative-offset"),
]


@pytest.mark.parametrize("fields, kind, fragment", MALFORMED)
def test_a_malformed_request_is_refused_naming_the_value_and_decodes_nothing(fields, kind, fragment):
    table, decoder = make_table(stream_idle_timeout_s=12.5), FakeDecoder()
    error = send_error(table, decoder, **{"correlation_id": 1, "flags": START, "codes": make_codes(3), **fields})
    assert (error.kind, error.code) == (kind, "INVALID_ARG") and fragment in str(error)
    assert decoder.calls == [] and table.stats().live_streams == 0 and table.stats().errors_by_kind[kind] == 1


# ---- what a request decodes: frame_offset, dedupe_mode, the resume point ----------------------------

R = make_codes(24, seed=4)
CHANGED = " differs from the frame stream 1 already decoded at that index; decoded frames cannot change (START a new " \
    "sequence instead)"
RESUMED = (R[:, 10:16], 10, 4)  # a START at frame 10 with history [10, 14) and new frames [14, 16)
REQUESTS = [  # (dedupe_mode (None: the default), the START (codes, frame_offset, history_frames), the requests
    # after it: (flags, codes, frame_offset, the frames it decodes or (kind, message)))
    pytest.param("delta", (A[:, :4], 0, None), [(0, A[:, :4], 0, NO_FRAMES)], id="identical-retry"),
    # 8 frames, 5 of them new: max_new_frames_per_request=6 counts only the new ones
    pytest.param("delta", (A[:, :4], 0, None), [(0, A[:, 1:9], 1, A[:, 4:9])], id="overlap-decodes-only-new-frames"),
    pytest.param("delta", (A[:, :4], 0, None), [(0, A[:, 1:3], 1, NO_FRAMES)], id="overlap-inside-the-decoded-frames"),
    pytest.param("delta", (silence(3), 0, None), [(0, silence(3), 3, silence(3))], id="same-frames-as-offset-deltas"),
    pytest.param("delta", (A[:, :3], None, None), [(0, A[:, :4], None, A[:, :4])], id="delta-decodes-a-resend-again"),
    pytest.param("delta", (A[:, :3], 0, None), [(0, A[:, :5], 0, A[:, 3:5])], id="delta-honours-frame-offset"),
    pytest.param("auto", (A[:, :4], None, None), [(0, A[:, :7], None, A[:, 4:7])], id="auto-resend-decodes-its-suffix"),
    pytest.param("auto", (A[:, :4], None, None), [(0, A[:, 4:7], None, A[:, 4:7])], id="auto-delta-is-decoded-whole"),
    # auto's documented limits: a silence delta that starts with every decoded frame is taken as a resend
    # (2 frames of audio lost); a resend shorter than the decoded frames as a delta (audio duplicated)
    pytest.param("auto", (silence(2), None, None), [(0, silence(3), None, silence(1))], id="auto-limit-silence-delta"),
    pytest.param("auto", (A[:, :4], None, None), [(0, A[:, :2], None, A[:, :2])], id="auto-limit-short-resend"),
    pytest.param("cumulative", (A[:, :3], None, None), [(0, A[:, :5], None, A[:, 3:5])], id="cumulative-suffix"),
    pytest.param("cumulative", (silence(2), None, None), [(0, silence(3), None, silence(1))], id="cumulative-silence"),
    # A pipeline's stage 0 sends 1 frame, then 5-frame deltas, without frame_offset; a listening duplex model
    # emits one silence code at length: by default, every frame is decoded once.
    pytest.param(None, (silence(1), None, None), [(0, silence(5), None, silence(5))] * 3 + [
        (0, silence(3), None, silence(3))], id="default-deltas-so-silence-is-never-lost"),
    pytest.param("cumulative", (R[:, :5], None, None), [
        (0, R[:, :4], None, ("not_cumulative", "dedupe_mode=cumulative: the request holds 4 frames but stream 1 has "
                             "decoded 5; a cumulative request starts with all of them")),
        (0, changed_at(R[:, :6], 1, codebook=2), None, ("changed_frame", "frame 1" + CHANGED)),
    ], id="cumulative-refuses-what-is-not-the-decoded-frames-and-more"),
    pytest.param("delta", RESUMED, [
        (0, R[:, 16:18], 16, R[:, 16:18]),
        (0, R[:, 12:20], 12, R[:, 18:20]),  # an overlap with the decoded frames (a retry) decodes only what is new
        (0, R[:, 21:23], 21, ("gap", "frame_offset 21 leaves a gap: stream 1 has decoded 20 frames, so frame_offset "
                                     "must be at most 20")),
        (0, changed_at(R[:, 11:21], 2, codebook=3), 11, ("changed_frame", "frame 13" + CHANGED)),
        (0, R[:, 9:16], 9, ("before_resume", "frame_offset 9 is before frame 10, where stream 1 was resumed on this "
                            "server: frames before 10 are not held here and cannot be compared; send frames from 10 on")),
        (END, R[:, 20:24], 20, R[:, 20:24]),  # the history counts as decoded: the next frame is 20
    ], id="resumed-offsets-are-stream-indices"),
    pytest.param("delta", RESUMED, [(0, R[:, 16:18], None, R[:, 16:18]), (0, R[:, 10:16], None, R[:, 10:16])],
                 id="resumed-delta-decodes-a-cumulative-resend-whole"),
    pytest.param("auto", RESUMED, [(0, R[:, 16:18], None, R[:, 16:18]), (0, R[:, 10:20], None, R[:, 18:20])],
                 id="resumed-auto-reads-a-resend-from-the-base"),
    pytest.param("cumulative", RESUMED, [
        (0, R[:, 10:18], None, R[:, 16:18]),
        (0, R[:, 12:19], None, ("not_cumulative", "dedupe_mode=cumulative: the request holds 7 frames but stream 1 "
                                "has decoded 8 since frame 10, where it was resumed on this server; a cumulative "
                                "request starts with all of them")),
        (0, R[:, :18], None, ("changed_frame", "frame 10" + CHANGED)),
    ], id="resumed-cumulative-requests-start-at-the-base"),
]


@pytest.mark.parametrize("mode, opening, requests", REQUESTS)
def test_a_request_decodes_only_the_frames_its_stream_has_not_decoded(mode, opening, requests):
    """Only new frames are decoded, found by frame_offset or else as dedupe_mode reads the request against the
    frames held since the stream's base (its START or resume point). A resumed stream's offsets stay stream
    indices, its history counts as decoded, frames before its base cannot be compared; a refused request
    changes nothing."""
    table = make_table(max_new_frames_per_request=6, **({} if mode is None else {"dedupe_mode": mode}))
    decoder = FakeDecoder()
    held, base, history_frames = opening
    send(table, decoder, 1, START, held, frame_offset=base, history_frames=history_frames)
    for flags, codes, frame_offset, outcome in requests:
        calls, errors = len(decoder.calls), dict(table.stats().errors_by_kind)
        if isinstance(outcome, tuple):
            error = send_error(table, decoder, 1, flags, codes, frame_offset=frame_offset)
            assert (error.kind, str(error)) == outcome and len(decoder.calls) == calls
            assert table.stats().errors_by_kind[error.kind] == errors[error.kind] + 1
        else:
            pcm = send(table, decoder, 1, flags, codes, frame_offset=frame_offset)
            assert pcm.dtype == np.float32
            np.testing.assert_array_equal(pcm, expected_pcm(outcome))
            held = np.concatenate([held, outcome], axis=1)
            assert not any(step_flags & START for step_flags in decoder.flags()[calls:])
        if not flags & END:
            assert base_of(table, 1) == (base or 0)
            np.testing.assert_array_equal(decoded_of(table, 1), held)
        np.testing.assert_array_equal(decoder.decoded_codes(), held)
        assert table.stats().frames_decoded == held.shape[1]
    assert is_live(table, 1) == (not flags & END)


# ---- rejected requests: the stream is unchanged, unless the request carried END ----------------------

REJECTED = [  # (request fields, kind, message) against a stream holding frames 0-2 of A
    pytest.param(dict(input_ids=np.zeros((1, 8), np.float64)), "dtype", "input_ids must be INT64, got float64",
                 id="dtype"),
    pytest.param(dict(input_ids=np.zeros((1, 9), np.int64)), "length",
                 "input_ids holds 9 codes, not a multiple of num_codebooks=8", id="length"),
    pytest.param(dict(input_ids=np.full((1, NUM_CODEBOOKS), CODEBOOK_SIZE, np.int64)), "code_range",
                 "input_ids[0] = 2048 (codebook 0, frame 0) is outside [0, 2048)", id="code_range"),
    pytest.param(dict(frame_offset=-2), "negative_offset", "frame_offset must be >= 0, got -2", id="negative_offset"),
    pytest.param(dict(frame_offset=9), "gap",
                 "frame_offset 9 leaves a gap: stream 1 has decoded 3 frames, so frame_offset must be at most 3", id="gap"),
    pytest.param(dict(codes=changed_at(A[:, :2], 1), frame_offset=0), "changed_frame",
                 "frame 1 differs from the frame stream 1 already decoded at that index", id="changed_frame"),
    pytest.param(dict(codes=make_codes(4, seed=3)), "limit",
                 "request has 4 new frames, more than max_new_frames_per_request=3", id="limit-new"),
    pytest.param(dict(frame_offset=2, history_frames=4), "history", "history_frames=4 must lie in [0, 2]",
                 id="history"),  # with START: a resume refused, the live stream kept
    pytest.param(dict(codes=A[:, 2:5], frame_offset=2, history_frames=1), "history_offset",
                 "history_frames=1 on a continuing stream needs frame_offset=3, the stream's next frame (got 2): "
                 "history is decoded once, after the frames stream 1 holds", id="history_offset"),
    pytest.param(dict(codes=A[:, 3:7], frame_offset=3, history_frames=2), "limit",
                 "request decodes 4 frames (2 history_frames + 2 new), more than max_new_frames_per_request=3",
                 id="limit-with-history"),
    # 5 frames, only 2 of them new: too long all the same
    pytest.param(dict(codes=A[:, :5], frame_offset=0), "limit", "request holds 5 frames, more than max_request_frames=4",
                 id="limit-request"),
]


def send_rejected(fields, kind, message, flags):
    """A stream holding frames 0-2 of A, then one REJECTED request with `flags`, checked against its kind
    and message. Returns (table, decoder, decoder calls before it, error)."""
    table, decoder = make_table(max_new_frames_per_request=3, max_request_frames=4), FakeDecoder()
    send(table, decoder, 1, START, A[:, :3])
    calls = len(decoder.calls)
    if kind in ("gap", "changed_frame", "history_offset") and flags & START:  # START restarts: offset 1 is a gap
        fields, kind, message = dict(frame_offset=1), "gap", "frame_offset 1 leaves a gap: stream 1 has decoded 0 frames"
    error = send_error(table, decoder, 1, flags, **{"codes": make_codes(2, seed=3), **fields})
    assert error.kind == kind and message in str(error)
    return table, decoder, calls, error


@pytest.mark.parametrize("flags", [0, START], ids=["plain", "start"])
@pytest.mark.parametrize("fields, kind, message", REJECTED)
def test_a_rejected_request_leaves_the_stream_unchanged(fields, kind, message, flags):
    table, decoder, calls, error = send_rejected(fields, kind, message, flags)
    assert error.code == "INVALID_ARG" and len(decoder.calls) == calls
    np.testing.assert_array_equal(decoded_of(table, 1), A[:, :3])
    assert table.stats().errors_by_kind[error.kind] == 1
    # The stream carries on where it was: no START needed, the next frame is still frame 3.
    np.testing.assert_array_equal(send(table, decoder, 1, 0, A[:, 3:5], frame_offset=3), expected_pcm(A[:, 3:5]))
    assert decoder.flags()[-2:] == [0, 0]


@pytest.mark.parametrize("fields, kind, message", REJECTED)
def test_a_rejected_request_with_end_ends_the_stream(fields, kind, message):
    """Triton releases a sequence when it schedules its END request, whatever the model answers:
    the stream ends, and its decoder sequence gets a discarded END step of zero codes."""
    table, decoder, calls, error = send_rejected(fields, kind, message, END)
    assert str(error).endswith("; the request carried END, so the stream has ended") and not is_live(table, 1)
    assert len(decoder.calls) == calls + 1 and decoder.flags()[-1] == END and not decoder.calls[-1][1].any()


# ---- lifecycle ---------------------------------------------------------------------------------------

B = make_codes(4, seed=1)
LIFECYCLE = [  # the requests (flags, codes, frame_offset) of stream 7 -> the flags of its decoder steps
    pytest.param([(START, A[:, :3], None), (0, A[:, 3:5], None), (END, A[:, 5:6], None)], [START, 0, 0, 0, 0, END],
                 id="start-continue-end"),
    pytest.param([(START | END, A[:, :3], None)], [START, 0, END], id="start-end-in-one-request"),
    pytest.param([(START | END, A[:, :1], None)], [START | END], id="start-end-single-frame-is-one-step"),
    pytest.param([(START | END, None, None)], [], id="start-end-without-frames-calls-no-decoder"),
    pytest.param([(START, None, None), (END, None, None)], [], id="start-then-end-without-frames-calls-no-decoder"),
    pytest.param([(START, B, None), (START, A[:, :3], 0)], [START, 0, 0, 0, START, 0, 0], id="barge-in-restarts-at-0"),
    pytest.param([(START, B[:, :2], None), (START, None, None), (0, A[:, :2], 0)], [START, 0, START, 0],
                 id="barge-in-without-frames-restarts-the-decoder-on-the-next-step"),
    pytest.param([(START, B[:, :2], None), (START | END, None, None)], [START, 0, END],
                 id="barge-in-start-end-without-frames-closes-the-old-decoder-sequence"),
]


@pytest.mark.parametrize("requests, step_flags", LIFECYCLE)
def test_start_opens_or_restarts_a_stream_and_end_removes_it(requests, step_flags):
    table, decoder = make_table(), FakeDecoder()
    held = NO_FRAMES
    for flags, codes, frame_offset in requests:
        codes = NO_FRAMES if codes is None else codes
        np.testing.assert_array_equal(send(table, decoder, 7, flags, codes, frame_offset=frame_offset),
                                      expected_pcm(codes))
        held = np.concatenate([NO_FRAMES if flags & START else held, codes], axis=1)
        assert is_live(table, 7) == (not flags & END) and table.stats().live_streams == int(not flags & END)
        if not flags & END:
            np.testing.assert_array_equal(decoded_of(table, 7), held)
    assert decoder.flags() == step_flags and {cid for cid, _, _ in decoder.calls} <= {7}
    if not is_live(table, 7):  # later requests must START again
        assert send_error(table, decoder, 7, 0, A[:, :1]).kind == "unknown_stream"


def test_end_without_new_frames_closes_the_decoder_with_one_discarded_step_of_zeros():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(3)
    send(table, decoder, 1, START, codes)
    plan = plan_of(table, 1, END, flat(codes), offset(0))  # a retry carrying END: no new frame
    assert plan.new_frames == 0 and [step.flags for step in plan.steps] == [END] and plan.steps[0].discard_output
    plan = plan_of(table, 1, END, flat(make_codes(4)), offset(0))
    assert plan.new_frames == 1 and not plan.steps[-1].discard_output
    plan = plan_of(table, 2, START, flat(codes))  # a new stream's plan: int32 codes, one step per frame
    assert plan.new_codes.dtype == np.int32 and [step.flags for step in plan.steps] == [START, 0, 0]
    np.testing.assert_array_equal(plan.new_codes, codes)
    assert is_live(table, 1) and not is_live(table, 2)  # planning changes nothing
    assert send(table, decoder, 1, END, codes, frame_offset=0).shape == (1, 0)
    assert decoder.flags() == [START, 0, 0, END] and not is_live(table, 1)
    _, trailing, _ = decoder.calls[-1]
    assert trailing.shape == (1, NUM_CODEBOOKS, 1) and not trailing.any()


DECODER_FAILURES = [  # (the FakeDecoder, frames per call, kind, code, fragment) for a START of 3 frames
    pytest.param(dict(wrong_size_on_call=2), 1, "decoder", "INTERNAL",
                 f"on step 2 of 3 for stream 1: returned {SAMPLES - 1} samples for 1 frame(s), expected {SAMPLES}",
                 id="wrong-size"),
    pytest.param(dict(fail_on_call=2), 2, "decoder", "INTERNAL", "on step 2 of 2 for stream 1: simulated decoder failure",
                 id="later-call-of-a-request"),
    pytest.param(dict(fail_on_call=1, error=KeyError("pcm")), 1, "decoder", "INTERNAL",
                 "on step 1 of 3 for stream 1: 'pcm'", id="unexpected-exception"),
    pytest.param(dict(fail_on_call=1, error=DecoderError("boom")), 1, "decoder", "INTERNAL", "boom", id="decoder-error"),
    pytest.param(dict(fail_on_call=1, error=DecoderError("no room", "UNAVAILABLE", "stream_cap")), 1, "stream_cap",
                 "UNAVAILABLE", "no room", id="decoder-refuses-a-new-stream"),
    pytest.param(dict(fail_on_call=1, error=DecoderError("shutting down", "UNAVAILABLE", "unavailable")), 1,
                 "unavailable", "UNAVAILABLE", "shutting down", id="server-shutting-down"),
]


@pytest.mark.parametrize("decoder, frames_per_call, kind, code, fragment", DECODER_FAILURES)
def test_a_decoder_failure_ends_the_stream_keeping_its_code(decoder, frames_per_call, kind, code, fragment):
    """A decoder refusing a new stream (its own cap) or a server shutting down reach the client as
    UNAVAILABLE (it may retry), counted under their own kinds; any other failure is INTERNAL."""
    table = make_table(decoder_max_frames_per_step=frames_per_call)
    error = send_error(table, FakeDecoder(**decoder), 1, START, make_codes(3), error=DecoderError)
    assert (error.kind, error.code) == (kind, code) and fragment in str(error)
    assert "send its next request with the START flag" in str(error)
    assert type(error.__cause__) is type(decoder.get("error", DecoderError("")))  # the traceback's, not the message's
    assert type(error.__cause__).__name__ not in str(error)
    assert not is_live(table, 1) and table.stats().errors_by_kind[kind] == 1


def test_a_decoder_failure_part_way_ends_the_stream_and_start_begins_it_again():
    table, decoder = make_table(), FakeDecoder(fail_on_call=4)
    codes = make_codes(5)
    send(table, decoder, 1, START, codes[:, :2])
    error = send_error(table, decoder, 1, 0, codes[:, 2:], frame_offset=2, error=DecoderError)
    assert "failed on step 2 of 3 for stream 1" in str(error)
    assert len(decoder.calls) == 4 and not is_live(table, 1)  # the third step was never sent
    assert table.stats().frames_decoded == 2
    assert send_error(table, decoder, 1, 0, codes[:, 4:], frame_offset=4).kind == "unknown_stream"
    send(table, decoder, 1, START, codes, frame_offset=0)
    assert decoder.flags()[-5] == START
    np.testing.assert_array_equal(decoded_of(table, 1), codes)


@pytest.mark.parametrize("frames, max_frames, request_flags, sizes, step_flags", [
    pytest.param(3, 1, START | END, [1, 1, 1], [START, 0, END], id="one-frame-per-call"),
    pytest.param(1, 16, START, [1], [START], id="1-frame-request-1-frame-step"),
    pytest.param(16, 16, START | END, [16], [START | END], id="one-call-up-to-max"),
    pytest.param(7, 4, START | END, [4, 3], [START, END], id="full-calls-then-remainder"),
    pytest.param(9, 4, START, [4, 4, 1], [START, 0, 0], id="three-calls"),
])
def test_new_frames_go_to_the_decoder_in_as_few_calls_as_it_takes(frames, max_frames, request_flags, sizes, step_flags):
    """...and their PCM comes back as one float32 [1, samples_per_frame * F], C-contiguous."""
    table = make_table(decoder_max_frames_per_step=max_frames, samples_per_frame=SAMPLES_PER_FRAME)
    decoder = FakeDecoder(samples_per_frame=SAMPLES_PER_FRAME)
    codes = make_codes(frames)
    pcm = send(table, decoder, 1, request_flags, codes)
    assert decoder.sizes() == sizes and decoder.flags() == step_flags
    assert pcm.dtype == np.float32 and pcm.flags.c_contiguous
    np.testing.assert_array_equal(pcm, expected_pcm(codes, SAMPLES_PER_FRAME))


# ---- idle expiry -------------------------------------------------------------------------------------

def test_idle_streams_expire_on_the_next_batch_once_past_the_timeout_and_its_grace():
    """Idle time runs from the last decoder step: retries and rejected requests never reach the
    decoder, whose own idle timeout would otherwise drop the state under a live stream."""
    clock = FakeClock()
    table, decoder = make_table(clock=clock, stream_idle_timeout_s=30.0), FakeDecoder()
    send(table, decoder, 1, START, make_codes(1))
    send(table, decoder, 2, START, make_codes(1))
    clock.now += 20.0
    send(table, decoder, 2, 0, make_codes(2), frame_offset=0)
    send_error(table, decoder, 1, 0, make_codes(1), frame_offset=5)
    assert send(table, decoder, 1, 0, make_codes(1), frame_offset=0).size == 0  # identical retry
    clock.now += 10.0 + core.IDLE_GRACE_S  # stream 1 idle exactly the timeout plus the grace: kept
    assert table.expire_idle() == []
    clock.now += 0.001
    asyncio.run(process_batch(table, [], decoder))
    assert not is_live(table, 1) and is_live(table, 2)
    assert table.stats().streams_expired == 1 and table.stats().live_streams == 1
    assert send_error(table, decoder, 1, 0, make_codes(2), frame_offset=1).kind == "unknown_stream"


def test_a_stream_with_a_request_in_the_batch_or_still_decoding_is_not_expired():
    # Triton accepted the request as part of a live sequence, so the stream is live.
    async def scenario():
        clock = FakeClock()
        table, decoder = make_table(clock=clock, stream_idle_timeout_s=30.0), FakeDecoder()
        codes = make_codes(3)
        await table.submit(StreamRequest(1, START, flat(codes[:, :1])), decoder)
        clock.now += 100.0
        (pcm,) = await process_batch(table, [StreamRequest(1, 0, flat(codes[:, :2]), offset(0))], decoder)
        np.testing.assert_array_equal(pcm, expected_pcm(codes[:, 1:2]))
        decoder.gated.add(1)
        pending = table.submit(StreamRequest(1, 0, flat(codes[:, 2:]), offset(2)), decoder)
        clock.now += 100.0
        assert table.expire_idle() == [] and is_live(table, 1)
        decoder.gate.set()
        np.testing.assert_array_equal(await pending, expected_pcm(codes[:, 2:]))

    asyncio.run(scenario())


# ---- batches -----------------------------------------------------------------------------------------

def test_a_batch_overlaps_its_streams_keeps_each_in_order_and_one_bad_request_fails_alone_counted_by_kind():
    table, decoder = make_table(), FakeDecoder(fail_on_call=1)
    a, b = make_codes(3, seed=1), make_codes(6, seed=2)
    requests = [
        StreamRequest(5, START, flat(make_codes(1))),  # the decoder fails on its step (the batch's first)
        StreamRequest(1, START, flat(a)),
        StreamRequest(2, START, flat(b[:, :3])),
        StreamRequest(2, 0, flat(b[:, 3:])),  # the same stream twice in one batch: runs after
        StreamRequest(6, 0, flat(a)),  # unknown stream
        StreamRequest(7, START, np.zeros((1, 3), np.int64)),  # bad length
    ]
    results = asyncio.run(process_batch(table, requests, decoder))
    assert isinstance(results[0], DecoderError)
    for result, codes in zip(results[1:4], (a, b[:, :3], b[:, 3:])):
        np.testing.assert_array_equal(result, expected_pcm(codes))
    assert [(type(r), r.kind) for r in results[4:]] == [(RequestError, "unknown_stream"), (RequestError, "length")]
    assert [cid for cid in (1, 2, 5, 6, 7) if is_live(table, cid)] == [1, 2]
    table.count_error("internal")  # model.py counts the failures outside the core
    stats = table.stats()
    assert (stats.live_streams, stats.frames_decoded, stats.streams_resumed) == (2, 3 + 6, 0)
    assert {kind: count for kind, count in stats.errors_by_kind.items() if count} == {
        "decoder": 1, "unknown_stream": 1, "length": 1, "internal": 1}
    assert set(code2wav_settings.ERROR_KINDS) <= set(stats.errors_by_kind)
    np.testing.assert_array_equal(decoder.decoded_codes(2), b)
    assert [flags for cid, _, flags in decoder.calls if cid == 2] == [START, 0, 0, 0, 0, 0]
    # The streams' steps were in flight together, one stream's never were.
    assert decoder.max_in_flight == 3
    assert [event for event, cid in decoder.events if cid == 2] == ["begin", "end"] * 6
    assert ("begin", 2) in decoder.events[:decoder.events.index(("end", 1))]


def test_a_long_request_holds_up_only_its_stream_whose_next_request_waits_for_its_finish():
    """Stream 1's long request (a resume's replay, say) still decodes while stream 2 sends three requests
    in three later batches: each finishes first, in order. Stream 1's next request, sent meanwhile, waits
    its turn: the previous request's finish (its response) goes out before its step reaches the decoder."""

    async def scenario():
        table, decoder = make_table(), FakeDecoder(gated={1})
        long, live = make_codes(20, seed=1), make_codes(3, seed=2)
        finished = []  # (request, stream 1's decoder steps by then)

        def finish(name):
            return lambda result: finished.append((name, decoder.decoded_codes(1).shape[1]))

        first = table.submit(StreamRequest(1, START, flat(long[:, :16])), decoder, finish("1a"))
        second = table.submit(StreamRequest(1, 0, flat(long[:, 16:]), offset(16)), decoder, finish("1b"))
        for frame in range(3):
            request = StreamRequest(2, START if frame == 0 else 0, flat(live[:, frame:frame + 1]), offset(frame))
            (task,) = table.submit_batch([request], decoder, [finish(f"2.{frame}")])
            np.testing.assert_array_equal(await task, expected_pcm(live[:, frame:frame + 1]))
            assert not first.done() and not second.done() and len(table._queued) == 1
        decoder.gate.set()
        np.testing.assert_array_equal(np.concatenate(await asyncio.gather(first, second), axis=1), expected_pcm(long))
        assert finished == [("2.0", 0), ("2.1", 0), ("2.2", 0), ("1a", 16), ("1b", 20)] and not table._queued
        np.testing.assert_array_equal(decoder.decoded_codes(1), long)

    asyncio.run(scenario())


def test_live_requests_are_one_step_without_history_and_their_streams_only_request_in_flight():
    """`live` says which requests execute may wait for and answer in its returned list; the others
    (past one step, a replay, a stream's second request in the batch or behind its stream's unfinished
    request) go through their senders, so that no answer overtakes another."""

    async def scenario():
        table, decoder = make_table(decoder_max_frames_per_step=4), FakeDecoder(gated={9})
        (slow,) = table.submit_batch([StreamRequest(9, START, flat(make_codes(2, seed=9)))], decoder)
        await asyncio.sleep(0)
        batch = [
            StreamRequest(1, START, flat(make_codes(1, seed=1))),  # one frame of an idle stream
            StreamRequest(2, START, flat(make_codes(4, seed=2))),  # one whole decoder step
            StreamRequest(3, START, flat(make_codes(5, seed=3))),  # two decoder steps
            StreamRequest(4, START, flat(make_codes(3, seed=4)), history_frames=np.array([[2]])),  # a replay
            StreamRequest(5, START, flat(make_codes(1, seed=5))),  # stream 5 twice in this batch
            StreamRequest(5, 0, flat(make_codes(1, seed=6)), offset(1)),
            StreamRequest(9, 0, flat(make_codes(1, seed=7)), offset(2)),  # behind stream 9's unfinished request
            StreamRequest(6, START, np.zeros(0, np.int64)),  # no frames
        ]
        assert table.live(batch) == [True, True, False, False, False, False, False, True]
        decoder.gate.set()
        await slow
        assert table.live(batch[6:7]) == [True]  # stream 9's request finished

    asyncio.run(scenario())


# ---- the stream cap ----------------------------------------------------------------------------------

def test_starts_past_max_live_streams_are_refused_and_touch_nothing():
    """Streams still opening (their START decoding) count toward the cap; a restart, a one-shot
    START|END and the refused stream's next request take no room; an END makes room again."""

    async def scenario():
        table, decoder = make_table(max_live_streams=2), FakeDecoder(gated={1, 2})
        codes = make_codes(2, seed=7)
        opening = table.submit_batch([StreamRequest(cid, START, flat(codes[:, :1])) for cid in (1, 2)], decoder)
        refused, after = await process_batch(table, [StreamRequest(3, START, flat(codes[:, :1])),
                                                     StreamRequest(3, 0, flat(codes[:, 1:]))], decoder)
        assert isinstance(refused, StreamCapError) and (refused.kind, refused.code) == ("stream_cap", "UNAVAILABLE")
        assert str(refused).startswith(
            "resource exhausted: this code2wav instance already holds 2 live streams, its limit (max_live_streams=2); "
            "the new stream was refused and no other stream was affected. Retry later, or END streams that are done")
        assert isinstance(after, RequestError) and after.kind == "unknown_stream"
        decoder.gate.set()
        for result in await asyncio.gather(*opening):
            np.testing.assert_array_equal(result, expected_pcm(codes[:, :1]))
        assert sorted(cid for cid, _, _ in decoder.calls) == [1, 2] and not is_live(table, 3)
        assert table.stats().errors_by_kind["stream_cap"] == 1
        results = await process_batch(table, [StreamRequest(1, START, flat(codes[:, :1])),
                                              StreamRequest(4, START | END, flat(codes[:, :1]))], decoder)
        assert not any(isinstance(result, Exception) for result in results) and table.stats().live_streams == 2
        await process_batch(table, [StreamRequest(2, END, flat(codes[:, 1:]))], decoder)
        (result,) = await process_batch(table, [StreamRequest(3, START, flat(codes[:, :1]))], decoder)
        assert not isinstance(result, Exception) and is_live(table, 3)

    asyncio.run(scenario())


# ---- decoded codes -----------------------------------------------------------------------------------

def test_decoded_codes_grow_geometrically_keep_every_frame_and_take_the_smallest_dtype():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(1000, seed=9)
    send(table, decoder, 1, START, codes[:, :1])
    capacities = set()
    position, step = 1, 1
    while position < 1000:
        stop = min(1000, position + step)
        send(table, decoder, 1, 0, codes[:, position:stop], frame_offset=position)
        capacities.add(table._streams[1].decoded.capacity)
        position, step = stop, step % 7 + 1
    decoded = decoded_of(table, 1)
    np.testing.assert_array_equal(decoded, codes)
    assert decoded.dtype == np.int16 and not decoded.flags.writeable
    assert len(capacities) <= 6  # 64 -> 128 -> ... -> 1024: a handful of reallocations
    assert 1000 <= max(capacities) <= 2048
    assert table.stats().frames_decoded == 1000
    large = code2wav_stream.DecodedCodes(NUM_CODEBOOKS, 40000)
    large.append(np.full((NUM_CODEBOOKS, 3), 39999, np.int64))
    assert large.dtype == np.int32
    np.testing.assert_array_equal(large.codes(), np.full((NUM_CODEBOOKS, 3), 39999))


# ---- resume by replay: START with history_frames -----------------------------------------------------

RESUMES = [  # (decoder frames per call, stream frames [first, stop) sent, frame_offset, history_frames, flags)
    pytest.param(1, 10, 17, 10, 4, START, id="1-frame-calls"),
    pytest.param(3, 10, 17, 10, 4, START, id="3-frame-calls-history-and-new-frames-never-share-one"),
    pytest.param(16, 10, 17, 10, 4, START, id="16-frame-calls"),
    pytest.param(1, 3, 7, 3, 4, START, id="history-only-returns-no-samples"),
    pytest.param(1, 5, 7, 5, 0, START, id="no-history-starts-the-stream-at-its-offset"),
    pytest.param(1, 0, 2, None, 0, START, id="no-history-no-offset-is-a-plain-start"),
    pytest.param(1, 2, 6, 2, 2, START | END, id="start-end-decodes-and-closes"),
]


@pytest.mark.parametrize("max_frames, first, stop, frame_offset, history_frames, flags", RESUMES)
def test_a_resumed_stream_returns_exactly_the_frames_after_its_history(max_frames, first, stop, frame_offset,
                                                                       history_frames, flags):
    """Every frame of the request is decoded, the decoder starting afresh on the history (in replay
    calls of their own), and the stream goes on in stream indices; only the new frames' PCM comes back."""
    # History and new frames alike count toward max_new_frames_per_request, here exactly reached.
    table = make_table(decoder_max_frames_per_step=max_frames, max_new_frames_per_request=stop - first)
    decoder = FakeDecoder()
    stream = make_codes(20)
    pcm = send(table, decoder, 1, flags, stream[:, first:stop], frame_offset=frame_offset, history_frames=history_frames)
    assert pcm.dtype == np.float32
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, first + history_frames:stop]))
    np.testing.assert_array_equal(decoder.decoded_codes(), stream[:, first:stop])

    def calls(frames, per_call):
        return [min(per_call, frames - done) for done in range(0, frames, per_call)]

    sizes = (calls(history_frames, min(max_frames, table.settings.replay_step_frames))
             + calls(stop - first - history_frames, max_frames))
    step_flags = [0] * len(sizes)
    step_flags[0] |= START
    step_flags[-1] |= flags & END
    assert decoder.sizes() == sizes and decoder.flags() == step_flags
    # Counted as a resume; the decoder ran the history frames too.
    assert (table.stats().streams_resumed, table.stats().frames_decoded) == (1, stop - first)
    if flags & END:
        assert not is_live(table, 1)
        return
    assert base_of(table, 1) == (frame_offset or 0)
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, first:stop])
    np.testing.assert_array_equal(send(table, decoder, 1, 0, stream[:, stop:stop + 2], frame_offset=stop),
                                  expected_pcm(stream[:, stop:stop + 2]))


def test_history_continues_a_stream_in_pieces():
    """A resume sent in pieces: START with the first history frames, then requests whose frames are
    all history, then the rest of the history with the new frames. Each piece is decoded once; only
    the new frames' PCM comes back."""
    table, decoder = make_table(decoder_max_frames_per_step=3), FakeDecoder()
    stream = make_codes(30)
    assert send(table, decoder, 1, START, stream[:, 10:15], frame_offset=10, history_frames=5).size == 0
    assert send(table, decoder, 1, 0, stream[:, 15:20], frame_offset=15, history_frames=5).size == 0
    pcm = send(table, decoder, 1, 0, stream[:, 20:26], frame_offset=20, history_frames=2)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 22:26]))
    np.testing.assert_array_equal(decoder.decoded_codes(), stream[:, 10:26])
    assert base_of(table, 1) == 10 and table.stats().streams_resumed == 1
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, 10:26])


def test_replayed_history_takes_the_replay_lane():
    """Four streams resume at once beside a live stream: a replay step starts while a live step is in
    the decoder only as the one replay step there, and the live stream's steps do not wait for the 16
    replay steps; on an instance without live traffic, several replay steps run together."""

    class Counting(FakeDecoder):
        def __init__(self):
            super().__init__()
            self.replay_in_flight = self.live_in_flight = self.most_replay_in_flight = 0
            self.replay_starts_beside_live = []  # replay steps in flight when one starts beside a live step

        async def __call__(self, correlation_id, codes, flags):
            replay = correlation_id != 9
            self.replay_in_flight += replay
            self.live_in_flight += not replay
            self.most_replay_in_flight = max(self.most_replay_in_flight, self.replay_in_flight)
            if replay and self.live_in_flight:
                self.replay_starts_beside_live.append(self.replay_in_flight)
            try:
                # Live steps outlast the lane's wait for them (REPLAY_WAIT_FOR_IDLE_S).
                await asyncio.sleep(0.001 if replay else 1.5 * code2wav_replay.REPLAY_WAIT_FOR_IDLE_S)
                return await super().__call__(correlation_id, codes, flags)
            finally:
                self.replay_in_flight -= replay
                self.live_in_flight -= not replay

    def resumes(table, decoder, codes):
        return [table.submit(StreamRequest(cid, START, flat(codes), offset(0), offset(8)), decoder)
                for cid in (1, 2, 3, 4)]

    async def scenario():
        table, decoder = make_table(decoder_max_frames_per_step=2), Counting()
        stream = make_codes(20)
        await table.submit(StreamRequest(9, START, flat(stream[:, :1]), offset(0)), decoder)
        replays = resumes(table, decoder, stream[:, :8])
        live = [table.submit(StreamRequest(9, 0, flat(stream[:, f:f + 1]), offset(f)), decoder) for f in range(1, 4)]
        await asyncio.gather(*replays, *live)
        assert decoder.replay_starts_beside_live and set(decoder.replay_starts_beside_live) == {1}
        ends = [(index, cid) for index, (event, cid) in enumerate(decoder.events) if event == "end"]
        assert max(i for i, cid in ends if cid == 9) < max(i for i, cid in ends if cid != 9)

        quiet, decoder = make_table(decoder_max_frames_per_step=2), Counting()
        await asyncio.gather(*resumes(quiet, decoder, stream[:, :8]))
        assert decoder.most_replay_in_flight == 4

    asyncio.run(scenario())


def test_barge_in_with_history_restarts_a_live_stream_at_the_resume_point_and_a_plain_start_at_zero():
    table, decoder = make_table(), FakeDecoder()
    old, stream = make_codes(5, seed=1), make_codes(12, seed=2)
    send(table, decoder, 1, START, old)
    decoder.calls.clear()
    pcm = send(table, decoder, 1, START, stream[:, 6:10], frame_offset=6, history_frames=3)  # barge-in with history
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 9:10]))
    assert decoder.flags() == [START, 0, 0, 0]
    assert base_of(table, 1) == 6 and table.stats().live_streams == 1
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, 6:10])
    pcm = send(table, decoder, 1, 0, stream[:, 10:12], frame_offset=10)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 10:12]))
    send(table, decoder, 1, START, stream[:, :2], frame_offset=0)
    assert base_of(table, 1) == 0
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, :2])
