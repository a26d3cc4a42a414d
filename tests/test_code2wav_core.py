"""Unit tests of code2wav's pure core (model_repository/code2wav/1/code2wav_*.py; no server). A fake
decoder records every step (stream, codes, flags) and returns PCM whose samples name their frame."""

import asyncio
import time

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLES_PER_FRAME

from helpers import MODEL_REPOSITORY, FakeClock, load_model_module, triton_model_config

MODEL_DIR = MODEL_REPOSITORY / "code2wav" / "1"

# Each name from the file that defines it (the sibling files import one another by module name).
core = load_model_module(MODEL_DIR / "code2wav_core.py")
code2wav_settings = load_model_module(MODEL_DIR / "code2wav_settings.py")
code2wav_plan = load_model_module(MODEL_DIR / "code2wav_plan.py")
model_errors = load_model_module(MODEL_REPOSITORY / "common" / "model_errors.py")

START = code2wav_settings.FLAG_SEQUENCE_START
END = code2wav_settings.FLAG_SEQUENCE_END
StreamRequest = code2wav_plan.StreamRequest
DecoderError = code2wav_settings.DecoderError
RequestError = code2wav_settings.RequestError
SAMPLES = 4  # samples per frame in most tests: small, so outputs are easy to read


# ---- helpers -----------------------------------------------------------------------------------------

def make_codes(frames, seed=0):
    """Random distinct frames [k, frames] (codebook 0 holds the index); make_codes(n) is a prefix of make_codes(n + m)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, CODEBOOK_SIZE, size=(frames, NUM_CODEBOOKS), dtype=np.int64).T.copy()
    codes[0] = (np.arange(frames) + 7 * seed) % CODEBOOK_SIZE
    return codes


def silence(frames):  # identical frames, as a listening duplex model emits
    return np.full((NUM_CODEBOOKS, frames), 5, np.int64)


def changed_at(codes, frame, codebook=0, value=None):
    """A copy of codes [k, F] whose `frame` differs in one code (set to `value`, if given)."""
    codes = codes.copy()
    codes[codebook, frame] = (codes[codebook, frame] + 1) % CODEBOOK_SIZE if value is None else value
    return codes


A = make_codes(9)  # one stream's frames, for the tables below
NO_FRAMES = np.zeros((NUM_CODEBOOKS, 0), np.int64)


def flat(codes):  # codes [k, F] -> input_ids INT64 [1, k*F], codebook-major
    return np.ascontiguousarray(codes, dtype=np.int64).reshape(1, -1)


def offset(value):  # an optional scalar input: an int as INT64 [1, 1]; None or an array as it is
    return value if value is None or isinstance(value, np.ndarray) else np.array([[value]], dtype=np.int64)


def expected_pcm(codes, samples_per_frame=SAMPLES):
    """The fake decoder's PCM of codes [k, F]: [1, F * samples_per_frame], one value per frame naming it."""
    codes = np.asarray(codes, dtype=np.float64)
    signature = (codes[0] + codes[1] / 4096.0 + codes[2] / 4096.0**2).astype(np.float32)
    return np.repeat(signature, samples_per_frame)[None, :]


def assert_pcm(pcm, codes, samples_per_frame=SAMPLES):  # the fake decoder's PCM of codes [k, F], C-contiguous
    assert pcm.dtype == np.float32 and pcm.flags.c_contiguous
    np.testing.assert_array_equal(pcm, expected_pcm(codes, samples_per_frame))


class FakeDecoder:
    """Records every step and returns its expected_pcm; call `fail_on_call` (from 1) raises `error`,
    `wrong_size_on_call` returns a sample short; `gated` streams wait for `gate`; `delays[c]`: stream c's step."""

    def __init__(self, samples_per_frame=SAMPLES, fail_on_call=None, error=None, wrong_size_on_call=None, gated=(), delays=None):
        self.samples_per_frame = samples_per_frame
        self.fail_on_call, self.wrong_size_on_call = fail_on_call, wrong_size_on_call
        self.error = DecoderError("simulated decoder failure") if error is None else error
        self.gated, self.gate, self.delays = set(gated), asyncio.Event(), delays or {}
        self.calls = []  # (correlation_id, codes int32 [1, k, S], flags)
        self.events = []  # ("begin"/"end", correlation_id) in execution order
        self.running, self.overlaps = set(), []  # per step: (its stream, the streams in flight as it began)

    async def __call__(self, correlation_id, codes, flags):
        if correlation_id in self.gated:
            await self.gate.wait()
        assert codes.dtype == np.int32 and codes.ndim == 3 and codes.shape[:2] == (1, NUM_CODEBOOKS) and codes.flags.c_contiguous
        self.calls.append((correlation_id, codes.copy(), flags))
        call_number = len(self.calls)
        self.events.append(("begin", correlation_id))
        self.running.add(correlation_id)
        self.overlaps.append((correlation_id, frozenset(self.running)))
        try:
            await asyncio.sleep(self.delays.get(correlation_id, 0))  # let other streams' steps start
            if call_number == self.fail_on_call:
                raise self.error
            pcm = expected_pcm(codes[0], self.samples_per_frame)
            return pcm[:, :-1] if call_number == self.wrong_size_on_call else pcm
        finally:
            self.running.discard(correlation_id)
            self.events.append(("end", correlation_id))

    def flags(self):
        return [flags for _, _, flags in self.calls]

    def sizes(self):
        return [codes.shape[2] for _, codes, _ in self.calls]

    def decoded_codes(self, correlation_id=None):
        """The codes of every step (of one stream, if given), concatenated: [k, frames]."""
        chunks = [codes[0] for cid, codes, _ in self.calls if correlation_id in (None, cid)]
        return np.concatenate([np.zeros((NUM_CODEBOOKS, 0), np.int32), *chunks], axis=1)


def make_table(clock=time.monotonic, **overrides):
    """One frame per decoder call unless a test says otherwise (flags and failures read per frame)."""
    settings = {"samples_per_frame": SAMPLES, "decoder_max_frames_per_step": 1, **overrides}
    return core.StreamTable(code2wav_settings.Code2WavSettings(**settings), clock=clock)


def decoded_of(table, correlation_id):  # a live stream's decoded codes [k, frames] (read-only) from its base on
    return table._streams[correlation_id].decoded.codes()


async def process_batch(table, requests, decode_step):  # per request, its PCM or the exception it failed with
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


# ---- settings (parsing the checked-in config: test_configs.py; the policy: test_model_common.py) -----

@pytest.mark.parametrize("change, parameter, message", [
    pytest.param({"num_codebooks": None}, "num_codebooks", "missing", id="missing"),
    pytest.param({"samples_per_frame": "0"}, "samples_per_frame", "positive integer", id="zero"),
    pytest.param({"max_request_frames": "-1"}, "max_request_frames", "positive integer", id="negative"),
    pytest.param({"decoder_frames_per_step": "1"}, "decoder_frames_per_step", "unknown parameter (known: decoder_model_name, num_codebooks", id="removed"),
    pytest.param({"dedupe_mode": "both"}, "dedupe_mode", "auto, delta, cumulative", id="mode"),
    pytest.param({"decoder_model_name": " "}, "decoder_model_name", "non-empty", id="name"),
])
def test_bad_parameters_fail_naming_the_parameter(change, parameter, message):
    defaults = code2wav_settings.Code2WavSettings()  # a change of None removes that parameter
    parameters = {name: str(getattr(defaults, name)) for name in code2wav_settings.PARAMETER_TYPES}
    with pytest.raises(model_errors.ConfigError) as info:
        code2wav_settings.settings_from_config(triton_model_config({**parameters, **change}))
    assert info.value.parameter == parameter
    assert f"'{parameter}'" in str(info.value) and message in str(info.value)


# ---- what a request decodes: frame_offset, dedupe_mode, the resume point ----------------------------

R = make_codes(24, seed=4)
CHANGED = " differs from the frame stream 1 already decoded at that index; decoded frames cannot change (START a new sequence instead)"
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
    pytest.param(None, (silence(1), None, None), [(0, silence(5), None, silence(5))] * 3 + [(0, silence(3), None, silence(3))], id="default-deltas-so-silence-is-never-lost"),
    pytest.param("cumulative", (R[:, :5], None, None), [
        (0, R[:, :4], None, ("not_cumulative", "dedupe_mode=cumulative: the request holds 4 frames but stream 1 has decoded 5; a cumulative request starts with all of them")),
        (0, changed_at(R[:, :6], 1, codebook=2), None, ("changed_frame", "frame 1" + CHANGED)),
    ], id="cumulative-refuses-what-is-not-the-decoded-frames-and-more"),
    pytest.param("delta", RESUMED, [
        (0, R[:, 16:18], 16, R[:, 16:18]),
        (0, R[:, 12:20], 12, R[:, 18:20]),  # an overlap with the decoded frames (a retry) decodes only what is new
        (0, R[:, 21:23], 21, ("gap", "frame_offset 21 leaves a gap: stream 1 has decoded 20 frames, so frame_offset must be at most 20")),
        (0, changed_at(R[:, 11:21], 2, codebook=3), 11, ("changed_frame", "frame 13" + CHANGED)),
        (0, R[:, 9:16], 9, ("before_resume", "frame_offset 9 is before frame 10, where stream 1 was resumed on this server: frames before 10 are not held here and cannot be compared; send frames from 10 on")),
        (END, R[:, 20:24], 20, R[:, 20:24]),  # the history counts as decoded: the next frame is 20
    ], id="resumed-offsets-are-stream-indices"),
    pytest.param("delta", RESUMED, [(0, R[:, 16:18], None, R[:, 16:18]), (0, R[:, 10:16], None, R[:, 10:16])], id="resumed-delta-decodes-a-cumulative-resend-whole"),
    pytest.param("auto", RESUMED, [(0, R[:, 16:18], None, R[:, 16:18]), (0, R[:, 10:20], None, R[:, 18:20])], id="resumed-auto-reads-a-resend-from-the-base"),
    pytest.param("cumulative", RESUMED, [
        (0, R[:, 10:18], None, R[:, 16:18]),
        (0, R[:, 12:19], None, ("not_cumulative", "dedupe_mode=cumulative: the request holds 7 frames but stream 1 has decoded 8 since frame 10, where it was resumed on this server; a cumulative request starts with all of them")),
        (0, R[:, :18], None, ("changed_frame", "frame 10" + CHANGED)),
    ], id="resumed-cumulative-requests-start-at-the-base"),
]


@pytest.mark.parametrize("mode, opening, requests", REQUESTS)
def test_a_request_decodes_only_the_frames_its_stream_has_not_decoded(mode, opening, requests):
    """New frames: by frame_offset, else by dedupe_mode against the frames held since the stream's base."""
    table = make_table(max_new_frames_per_request=6, **({} if mode is None else {"dedupe_mode": mode}))
    decoder = FakeDecoder()
    held, base, history_frames = opening
    send(table, decoder, 1, START, held, frame_offset=base, history_frames=history_frames)
    for flags, codes, frame_offset, outcome in requests:
        calls, errors = len(decoder.calls), dict(table.errors_by_kind)
        if isinstance(outcome, tuple):
            error = send_error(table, decoder, 1, flags, codes, frame_offset=frame_offset)
            assert (error.kind, str(error)) == outcome and len(decoder.calls) == calls
            assert table.errors_by_kind[error.kind] == errors[error.kind] + 1
        else:
            pcm = send(table, decoder, 1, flags, codes, frame_offset=frame_offset)
            assert_pcm(pcm, outcome)
            held = np.concatenate([held, outcome], axis=1)
            assert not any(step_flags & START for step_flags in decoder.flags()[calls:])
        if not flags & END:
            assert table._streams[1].base == (base or 0)
            np.testing.assert_array_equal(decoded_of(table, 1), held)
        np.testing.assert_array_equal(decoder.decoded_codes(), held)
        assert table.frames_decoded == held.shape[1]
    assert (1 in table._streams) == (not flags & END)


def test_decoded_codes_grow_geometrically_keep_every_frame_and_take_the_smallest_dtype():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(1000, seed=9)
    send(table, decoder, 1, START, codes[:, :1])
    capacities, position, step = set(), 1, 1
    while position < 1000:
        stop = min(1000, position + step)
        send(table, decoder, 1, 0, codes[:, position:stop], frame_offset=position)
        capacities.add(table._streams[1].decoded._codes.shape[1])
        position, step = stop, step % 7 + 1
    decoded = decoded_of(table, 1)
    np.testing.assert_array_equal(decoded, codes)
    assert decoded.dtype == np.int16 and not decoded.flags.writeable
    assert len(capacities) <= 6 and 1000 <= max(capacities) <= 2048  # 64 -> 128 -> ... -> 1024: a few reallocations
    assert table.frames_decoded == 1000
    large = code2wav_plan.DecodedCodes(NUM_CODEBOOKS, 40000)
    large.append(np.full((NUM_CODEBOOKS, 3), 39999, np.int64))
    assert large.codes().dtype == np.int32
    np.testing.assert_array_equal(large.codes(), np.full((NUM_CODEBOOKS, 3), 39999))


# ---- rejected requests: nothing decoded, the stream unchanged unless the request carried END ---------

REJECTED = [  # (request fields beside 2 frames of codes, kind, a fragment of the message) against any stream
    pytest.param(dict(input_ids=np.zeros((1, 16), np.int32)), "dtype", "input_ids must be INT64, got int32", id="int32"),
    pytest.param(dict(input_ids=np.zeros((1, 9), np.int64)), "length", "input_ids holds 9 codes, not a multiple of num_codebooks=8", id="length"),
    pytest.param(dict(input_ids=np.zeros((2, 8), np.int64)), "shape", "input_ids must have shape [1, k*F] (one request of flat codes), got [2, 8]", id="batch-2"),
    pytest.param(dict(input_ids=np.full((1, NUM_CODEBOOKS), CODEBOOK_SIZE, np.int64)), "code_range", "input_ids[0] = 2048 (codebook 0, frame 0) is outside [0, 2048)", id="code_range"),
    pytest.param(dict(codes=changed_at(make_codes(2, seed=3), 0, value=-1)), "code_range", "input_ids[0] = -1 (codebook 0, frame 0) is outside", id="code-negative"),
    pytest.param(dict(codes=changed_at(make_codes(2, seed=3), 1, 7, 99999)), "code_range", "input_ids[15] = 99999 (codebook 7, frame 1) is outside [0, 2048)", id="code-large"),
    pytest.param(dict(frame_offset=-2), "negative_offset", "frame_offset must be >= 0, got -2", id="negative_offset"),
    pytest.param(dict(frame_offset=np.array([[0.0]], np.float32)), "dtype", "frame_offset must be INT64, got float32", id="offset-float"),
    pytest.param(dict(frame_offset=np.array([[0, 1]], np.int64)), "shape", "frame_offset must hold one value ([1, 1]), got shape [1, 2]", id="offset-two-values"),
    pytest.param(dict(frame_offset=9), "gap", "frame_offset 9 leaves a gap: stream 1 has decoded 3 frames, so frame_offset must be at most 3", id="gap"),
    pytest.param(dict(codes=changed_at(A[:, :2], 1), frame_offset=0), "changed_frame", "frame 1 differs from the frame stream 1 already decoded at that index", id="changed_frame"),
    pytest.param(dict(codes=make_codes(4, seed=3)), "limit", "request has 4 new frames, more than max_new_frames_per_request=3", id="limit-new"),
    pytest.param(dict(frame_offset=2, history_frames=4), "history", "history_frames=4 must lie in [0, 2]: the request holds 2 frames", id="history"),
    pytest.param(dict(frame_offset=3, history_frames=-1), "history", "history_frames=-1 must lie in [0, 2]", id="history-negative"),
    pytest.param(dict(frame_offset=0, history_frames=np.array([[2]], np.int32)), "dtype", "history_frames must be INT64, got int32", id="history-int32"),
    pytest.param(dict(frame_offset=0, history_frames=np.array([[1, 2]], np.int64)), "shape", "history_frames must hold one value", id="history-two-values"),
    pytest.param(dict(codes=A[:, 2:5], frame_offset=2, history_frames=1), "history_offset",
                 "history_frames=1 on a continuing stream needs frame_offset=3, the stream's next frame (got 2): history is decoded once, after the frames stream 1 holds", id="history_offset"),
    pytest.param(dict(codes=A[:, 3:7], frame_offset=3, history_frames=2), "limit", "request decodes 4 frames (2 history_frames + 2 new), more than max_new_frames_per_request=3", id="limit-with-history"),
    # 5 frames, only 2 of them new on the stream below: too long all the same
    pytest.param(dict(codes=A[:, :5], frame_offset=0), "limit", "request holds 5 frames, more than max_request_frames=4", id="limit-request"),
]
STARTS_ONLY = [  # rows for a stream that is not open, or a START (a continuing stream's history needs its next frame)
    pytest.param(dict(history_frames=2), "history", "history_frames=2 needs frame_offset, the stream index of the request's first frame", id="history-no-offset"),
    pytest.param(dict(frame_offset=-2, history_frames=1), "negative_offset", "frame_offset must be >= 0, got -2", id="history-negative-offset"),
    *(pytest.param(dict(correlation_id=cid), "correlation_id", f"got {cid!r}", id=f"correlation-id-{cid}") for cid in (0, -3, "abc")),
    pytest.param(dict(correlation_id=42, flags=0), "unknown_stream", "stream 42 is not open: send the first request of "
                 "the sequence with the START flag (a stream ends with END, with a decoder error, or after 12.5 s idle)", id="unknown-stream"),
    pytest.param(dict(flags=0, frame_offset=7, history_frames=2), "unknown_stream", "START", id="history-unknown-stream"),
]


def send_rejected(flags, fields, kind, message, opened=None):
    """A REJECTED request to stream 1 (opened first with `opened`), checked (after a START, offsets make a gap)."""
    table, decoder = make_table(max_new_frames_per_request=3, max_request_frames=4, stream_idle_timeout_s=12.5), FakeDecoder()
    if opened is not None:
        send(table, decoder, 1, START, opened)
    calls = len(decoder.calls)
    if kind in ("gap", "changed_frame", "history_offset") and flags & START:
        fields, kind, message = dict(frame_offset=1), "gap", "frame_offset 1 leaves a gap: stream 1 has decoded 0 frames"
    error = send_error(table, decoder, **{"correlation_id": 1, "flags": flags, "codes": make_codes(2, seed=3), **fields})
    assert (error.kind, error.code) == (kind, "INVALID_ARG") and message in str(error)
    assert table.errors_by_kind[error.kind] == 1
    return table, decoder, error, calls


@pytest.mark.parametrize("fields, kind, message", REJECTED + STARTS_ONLY)
def test_a_malformed_start_is_refused_naming_the_value_and_decodes_nothing(fields, kind, message):
    table, decoder, _, _ = send_rejected(START, fields, kind, message)
    assert decoder.calls == [] and table.live_streams == 0


@pytest.mark.parametrize("flags", [0, START, END], ids=["plain", "start", "end"])
@pytest.mark.parametrize("fields, kind, message", REJECTED)
def test_a_rejected_request_leaves_the_stream_unchanged_unless_it_carried_end(fields, kind, message, flags):
    """Triton releases a sequence with its END, whatever the model answers: its decoder sequence gets an END step."""
    table, decoder, error, calls = send_rejected(flags, fields, kind, message, opened=A[:, :3])
    if flags & END:
        assert str(error).endswith("; the request carried END, so the stream has ended") and 1 not in table._streams
        assert len(decoder.calls) == calls + 1 and decoder.flags()[-1] == END and not decoder.calls[-1][1].any()
        return
    assert len(decoder.calls) == calls
    np.testing.assert_array_equal(decoded_of(table, 1), A[:, :3])
    # The stream carries on where it was: no START needed, the next frame is still frame 3.
    assert_pcm(send(table, decoder, 1, 0, A[:, 3:5], frame_offset=3), A[:, 3:5])
    assert decoder.flags()[-2:] == [0, 0]


# ---- lifecycle ---------------------------------------------------------------------------------------

B, C = make_codes(4, seed=1), make_codes(16, seed=2)
LIFECYCLE = [  # (decoder frames per call, the requests (flags, codes, frame_offset) of stream 7, the flags of its
    # decoder steps, their sizes (None: one frame each))
    pytest.param(1, [(START, A[:, :3], None), (0, A[:, 3:5], None), (END, A[:, 5:6], None)], [START, 0, 0, 0, 0, END], None, id="start-continue-end"),
    pytest.param(1, [(START | END, A[:, :3], None)], [START, 0, END], None, id="start-end-one-frame-per-call"),
    pytest.param(1, [(START | END, A[:, :1], None)], [START | END], None, id="start-end-single-frame-is-one-step"),
    pytest.param(16, [(START, A[:, :1], None)], [START], [1], id="1-frame-request-1-frame-step"),
    pytest.param(16, [(START | END, C, None)], [START | END], [16], id="one-call-up-to-max"),
    pytest.param(4, [(START | END, C[:, :7], None)], [START, END], [4, 3], id="full-calls-then-remainder"),
    pytest.param(4, [(START, A, None)], [START, 0, 0], [4, 4, 1], id="three-calls"),
    pytest.param(1, [(START | END, None, None)], [], None, id="start-end-without-frames-calls-no-decoder"),
    pytest.param(1, [(START, None, None), (END, None, None)], [], None, id="start-then-end-without-frames-calls-no-decoder"),
    pytest.param(1, [(START, B, None), (START, A[:, :3], 0)], [START, 0, 0, 0, START, 0, 0], None, id="barge-in-restarts-at-0"),
    pytest.param(1, [(START, B[:, :2], None), (START, None, None), (0, A[:, :2], 0)], [START, 0, START, 0], None, id="barge-in-without-frames-restarts-the-decoder-on-the-next-step"),
    pytest.param(1, [(START, B[:, :2], None), (START | END, None, None)], [START, 0, END], None, id="barge-in-start-end-without-frames-closes-the-old-decoder-sequence"),
    pytest.param(1, [(START, A[:, :3], None), (END, A[:, :3], 0)], [START, 0, 0, END], None, id="end-retry-without-new-frames-closes-the-decoder"),
]


@pytest.mark.parametrize("max_frames, requests, step_flags, sizes", LIFECYCLE)
def test_start_opens_or_restarts_a_stream_and_end_removes_it(max_frames, requests, step_flags, sizes):
    """Frames go in as few decoder calls as it takes; an END without frames closes the decoder's sequence."""
    table = make_table(decoder_max_frames_per_step=max_frames, samples_per_frame=SAMPLES_PER_FRAME)
    decoder = FakeDecoder(samples_per_frame=SAMPLES_PER_FRAME)
    held = NO_FRAMES
    for flags, codes, frame_offset in requests:
        codes = NO_FRAMES if codes is None else codes
        held = NO_FRAMES if flags & START else held
        new = codes if frame_offset is None else codes[:, held.shape[1] - frame_offset:]
        assert_pcm(send(table, decoder, 7, flags, codes, frame_offset=frame_offset), new, SAMPLES_PER_FRAME)
        if flags & END and not new.size and decoder.calls:
            assert decoder.flags()[-1] == END and not decoder.calls[-1][1].any()
        held = np.concatenate([held, new], axis=1)
        assert (7 in table._streams) == (not flags & END) and table.live_streams == int(not flags & END)
        if not flags & END:
            np.testing.assert_array_equal(decoded_of(table, 7), held)
    assert decoder.sizes() == (sizes or [1] * len(step_flags))
    assert decoder.flags() == step_flags and {cid for cid, _, _ in decoder.calls} <= {7}
    if 7 not in table._streams:  # later requests must START again
        assert send_error(table, decoder, 7, 0, A[:, :1]).kind == "unknown_stream"


DECODER_FAILURES = [  # (the FakeDecoder, frames per call, frames opened before, kind, code, fragment) for the
    # request of frames [opened, opened + 3): a START, or the next request of a stream that `opened` frames opened
    pytest.param(dict(wrong_size_on_call=2), 1, 0, "decoder", "INTERNAL", f"on step 2 of 3 for stream 1: returned {SAMPLES - 1} samples for 1 frame(s), expected {SAMPLES}", id="wrong-size"),
    pytest.param(dict(fail_on_call=2), 2, 0, "decoder", "INTERNAL", "on step 2 of 2 for stream 1: simulated decoder failure", id="later-call-of-a-request"),
    pytest.param(dict(fail_on_call=4), 1, 2, "decoder", "INTERNAL", "failed on step 2 of 3 for stream 1: simulated decoder failure", id="part-way-through-a-stream"),
    pytest.param(dict(fail_on_call=1, error=KeyError("pcm")), 1, 0, "decoder", "INTERNAL", "on step 1 of 3 for stream 1: 'pcm'", id="unexpected-exception"),
    pytest.param(dict(fail_on_call=1, error=DecoderError("no room", "UNAVAILABLE", "stream_cap")), 1, 0, "stream_cap", "UNAVAILABLE", "no room", id="decoder-refuses-a-new-stream"),
    pytest.param(dict(fail_on_call=1, error=DecoderError("shutting down", "UNAVAILABLE", "unavailable")), 1, 0, "unavailable", "UNAVAILABLE", "shutting down", id="server-shutting-down"),
]


@pytest.mark.parametrize("failing, frames_per_call, opened, kind, code, fragment", DECODER_FAILURES)
def test_a_decoder_failure_ends_the_stream_keeping_its_code(failing, frames_per_call, opened, kind, code, fragment):
    """The decoder's own cap or a server shutting down is UNAVAILABLE (may retry), any other failure INTERNAL."""
    table, decoder = make_table(decoder_max_frames_per_step=frames_per_call), FakeDecoder(**failing)
    codes = make_codes(opened + 3)
    if opened:
        send(table, decoder, 1, START, codes[:, :opened])
    error = send_error(table, decoder, 1, 0 if opened else START, codes[:, opened:], frame_offset=opened, error=DecoderError)
    assert (error.kind, error.code) == (kind, code) and fragment in str(error)
    assert "send its next request with the START flag" in str(error)
    assert type(error.__cause__) is type(failing.get("error", DecoderError("")))  # the traceback's, not the message's
    assert type(error.__cause__).__name__ not in str(error)
    assert 1 not in table._streams and table.errors_by_kind[kind] == 1
    assert len(decoder.calls) == (decoder.fail_on_call or decoder.wrong_size_on_call)  # no later step
    assert table.frames_decoded == opened  # a failed request's steps are not counted
    assert send_error(table, decoder, 1, 0, codes[:, opened:], frame_offset=opened).kind == "unknown_stream"
    calls = len(decoder.calls)
    send(table, decoder, 1, START, codes, frame_offset=0)
    assert decoder.flags()[calls] == START
    np.testing.assert_array_equal(decoded_of(table, 1), codes)


def test_idle_streams_expire_on_the_next_batch_once_past_the_timeout_and_its_grace():
    """Idle time runs from the last decoder step (the decoder's own timeout runs from there too)."""
    clock = FakeClock()
    table, decoder = make_table(clock=clock, stream_idle_timeout_s=30.0), FakeDecoder()
    codes = make_codes(4)
    send(table, decoder, 1, START, codes[:, :1])
    send(table, decoder, 2, START, codes[:, :1])
    clock.now += 20.0
    send(table, decoder, 2, 0, codes[:, :2], frame_offset=0)
    send_error(table, decoder, 1, 0, codes[:, :1], frame_offset=5)
    assert send(table, decoder, 1, 0, codes[:, :1], frame_offset=0).size == 0  # identical retry
    clock.now += 10.0 + core.IDLE_GRACE_S  # stream 1 idle exactly the timeout plus the grace: kept
    assert table.expire_idle() == []
    clock.now += 0.001
    asyncio.run(process_batch(table, [], decoder))
    assert 1 not in table._streams and 2 in table._streams
    assert table.streams_expired == 1 and table.live_streams == 1
    assert send_error(table, decoder, 1, 0, codes[:, :2], frame_offset=1).kind == "unknown_stream"

    async def in_flight():
        clock.now += 100.0
        (pcm,) = await process_batch(table, [StreamRequest(2, 0, flat(codes[:, 1:3]), offset(1))], decoder)
        assert_pcm(pcm, codes[:, 2:3])  # in the batch: not expired first
        decoder.gated.add(2)
        pending = table.submit(StreamRequest(2, 0, flat(codes[:, 3:]), offset(3)), decoder)
        clock.now += 100.0
        assert table.expire_idle() == [] and 2 in table._streams
        decoder.gate.set()
        assert_pcm(await pending, codes[:, 3:])

    asyncio.run(in_flight())


# ---- batches and the stream cap -----------------------------------------------------------------------

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
        assert_pcm(result, codes)
    assert [(type(r), r.kind) for r in results[4:]] == [(RequestError, "unknown_stream"), (RequestError, "length")]
    assert [cid for cid in (1, 2, 5, 6, 7) if cid in table._streams] == [1, 2]
    table.count_error("internal")  # model.py counts the failures outside the core
    assert (table.live_streams, table.frames_decoded, table.streams_resumed) == (2, 3 + 6, 0)
    assert {kind: count for kind, count in table.errors_by_kind.items() if count} == {
        "decoder": 1, "unknown_stream": 1, "length": 1, "internal": 1}
    assert set(code2wav_settings.ERROR_KINDS) <= set(table.errors_by_kind)
    np.testing.assert_array_equal(decoder.decoded_codes(2), b)
    assert [flags for cid, _, flags in decoder.calls if cid == 2] == [START, 0, 0, 0, 0, 0]
    assert max(len(running) for _, running in decoder.overlaps) == 3  # streams' steps overlap, one stream's never
    assert [event for event, cid in decoder.events if cid == 2] == ["begin", "end"] * 6
    assert ("begin", 2) in decoder.events[:decoder.events.index(("end", 1))]


def test_a_long_request_holds_up_only_its_stream_whose_next_request_waits_for_its_finish():
    """`live`: the requests execute may answer in its returned list; the others use their senders, in order."""

    async def scenario():
        table, decoder = make_table(decoder_max_frames_per_step=4), FakeDecoder(gated={1})
        long, live = make_codes(20, seed=1), make_codes(3, seed=2)
        finished = []  # (request, stream 1's decoder steps by then)

        def finish(name):
            return lambda result: finished.append((name, decoder.decoded_codes(1).shape[1]))

        first = table.submit(StreamRequest(1, START, flat(long[:, :16])), decoder, finish("1a"))
        second = table.submit(StreamRequest(1, 0, flat(long[:, 16:]), offset(16)), decoder, finish("1b"))
        for frame in range(3):
            request = StreamRequest(2, START if frame == 0 else 0, flat(live[:, frame:frame + 1]), offset(frame))
            (task,) = table.submit_batch([request], decoder, [finish(f"2.{frame}")])
            assert_pcm(await task, live[:, frame:frame + 1])
            assert not first.done() and not second.done() and len(table._queued) == 1
        batch = [
            StreamRequest(3, START, flat(make_codes(1, seed=3))),  # one frame of an idle stream
            StreamRequest(4, START, flat(make_codes(4, seed=4))),  # one whole decoder step
            StreamRequest(5, START, flat(make_codes(5, seed=5))),  # two decoder steps
            StreamRequest(6, START, flat(make_codes(3, seed=6)), history_frames=np.array([[2]])),  # a replay
            StreamRequest(7, START, flat(make_codes(1, seed=7))),  # stream 7 twice in this batch
            StreamRequest(7, 0, flat(make_codes(1, seed=8)), offset(1)),
            StreamRequest(1, 0, flat(make_codes(1, seed=9)), offset(20)),  # behind stream 1's unfinished requests
            StreamRequest(8, START, np.zeros(0, np.int64)),  # no frames
        ]
        assert table.live(batch) == [True, True, False, False, False, False, False, True]
        decoder.gate.set()
        assert_pcm(np.concatenate(await asyncio.gather(first, second), axis=1), long)
        assert finished == [("2.0", 0), ("2.1", 0), ("2.2", 0), ("1a", 16), ("1b", 20)] and not table._queued
        np.testing.assert_array_equal(decoder.decoded_codes(1), long)
        assert table.live(batch[6:7]) == [True]  # stream 1's requests finished

    asyncio.run(scenario())


def test_starts_past_max_live_streams_are_refused_and_touch_nothing():
    """Opening streams count; a restart, a START|END and the refused stream's next request take no room."""

    async def scenario():
        table, decoder = make_table(max_live_streams=2), FakeDecoder(gated={1, 2})
        codes = make_codes(2, seed=7)
        opening = table.submit_batch([StreamRequest(cid, START, flat(codes[:, :1])) for cid in (1, 2)], decoder)
        refused, after = await process_batch(table, [StreamRequest(3, START, flat(codes[:, :1])),
                                                     StreamRequest(3, 0, flat(codes[:, 1:]))], decoder)
        assert isinstance(refused, model_errors.ModelError) and (refused.kind, refused.code) == ("stream_cap", "UNAVAILABLE")
        assert str(refused).startswith(
            "resource exhausted: this code2wav instance already holds 2 live streams, its limit (max_live_streams=2); "
            "the new stream was refused and no other stream was affected. Retry later, or END streams that are done")
        assert isinstance(after, RequestError) and after.kind == "unknown_stream"
        decoder.gate.set()
        for result in await asyncio.gather(*opening):
            assert_pcm(result, codes[:, :1])
        assert sorted(cid for cid, _, _ in decoder.calls) == [1, 2] and 3 not in table._streams
        assert table.errors_by_kind["stream_cap"] == 1
        results = await process_batch(table, [StreamRequest(1, START, flat(codes[:, :1])),
                                              StreamRequest(4, START | END, flat(codes[:, :1]))], decoder)
        assert not any(isinstance(result, Exception) for result in results) and table.live_streams == 2
        await process_batch(table, [StreamRequest(2, END, flat(codes[:, 1:]))], decoder)
        (result,) = await process_batch(table, [StreamRequest(3, START, flat(codes[:, :1]))], decoder)
        assert not isinstance(result, Exception) and 3 in table._streams

    asyncio.run(scenario())


# ---- resume by replay: START with history_frames -----------------------------------------------------

RESUMES = [  # (decoder frames per call, stream frames [first, stop) sent, frame_offset, history_frames, flags, frames
    # of an older stream 1 live before: a barge-in)
    pytest.param(1, 10, 17, 10, 4, START, 0, id="1-frame-calls"),
    pytest.param(3, 10, 17, 10, 4, START, 0, id="3-frame-calls-history-and-new-frames-never-share-one"),
    pytest.param(16, 10, 17, 10, 4, START, 0, id="16-frame-calls"),
    pytest.param(1, 3, 7, 3, 4, START, 0, id="history-only-returns-no-samples"),
    pytest.param(1, 5, 7, 5, 0, START, 0, id="no-history-starts-the-stream-at-its-offset"),
    pytest.param(1, 0, 2, None, 0, START, 0, id="no-history-no-offset-is-a-plain-start"),
    pytest.param(1, 2, 6, 2, 2, START | END, 0, id="start-end-decodes-and-closes"),
    pytest.param(1, 6, 10, 6, 3, START, 3, id="barge-in-restarts-a-live-stream-at-the-resume-point"),
]


@pytest.mark.parametrize("max_frames, first, stop, frame_offset, history_frames, flags, older", RESUMES)
def test_a_resumed_stream_returns_exactly_the_frames_after_its_history(max_frames, first, stop, frame_offset,
                                                                       history_frames, flags, older):
    """History in replay calls of its own, only new frames' PCM back; the stream goes on in stream indices."""
    # History and new frames alike count toward max_new_frames_per_request: exactly reached.
    table = make_table(decoder_max_frames_per_step=max_frames, max_new_frames_per_request=stop - first)
    decoder = FakeDecoder()
    stream = make_codes(24)
    if older:
        send(table, decoder, 1, START, make_codes(older, seed=1))
        decoder.calls.clear()
    pcm = send(table, decoder, 1, flags, stream[:, first:stop], frame_offset=frame_offset, history_frames=history_frames)
    assert_pcm(pcm, stream[:, first + history_frames:stop])
    np.testing.assert_array_equal(decoder.decoded_codes(), stream[:, first:stop])

    def calls(frames, per_call):
        return [min(per_call, frames - done) for done in range(0, frames, per_call)]

    sizes = (calls(history_frames, min(max_frames, table.settings.replay_step_frames))
             + calls(stop - first - history_frames, max_frames))
    step_flags = [START] + [0] * (len(sizes) - 1)
    step_flags[-1] |= flags & END
    assert decoder.sizes() == sizes and decoder.flags() == step_flags
    assert (table.streams_resumed, table.frames_decoded) == (1, older + stop - first)  # history included
    assert table.live_streams == int(not flags & END) == int(1 in table._streams)
    if flags & END:
        return
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, first:stop])
    # The next pieces of a resume: at the stream's next frame, each with history_frames of its own.
    assert send(table, decoder, 1, 0, stream[:, stop:stop + 2], frame_offset=stop, history_frames=2).size == 0
    pcm = send(table, decoder, 1, 0, stream[:, stop + 2:stop + 4], frame_offset=stop + 2, history_frames=1)
    assert_pcm(pcm, stream[:, stop + 3:stop + 4])
    np.testing.assert_array_equal(decoder.decoded_codes(), stream[:, first:stop + 4])
    assert table._streams[1].base == (frame_offset or 0) and table.streams_resumed == 1
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, first:stop + 4])
    send(table, decoder, 1, START, stream[:, :2], frame_offset=0)
    assert table._streams[1].base == 0
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, :2])


def test_replayed_history_takes_the_replay_lane():
    """Beside live steps, replay steps run one at a time; without live traffic, several run together."""
    # Live steps (stream 9's) outlast the lane's wait for them (REPLAY_WAIT_FOR_IDLE_S).
    delays = {9: 1.5 * core.REPLAY_WAIT_FOR_IDLE_S, 1: 0.001, 2: 0.001, 3: 0.001, 4: 0.001}

    def resumes(table, decoder, codes):
        return [table.submit(StreamRequest(cid, START, flat(codes), offset(0), offset(8)), decoder) for cid in (1, 2, 3, 4)]

    async def scenario():
        table, decoder = make_table(decoder_max_frames_per_step=2), FakeDecoder(delays=delays)
        stream = make_codes(20)
        await table.submit(StreamRequest(9, START, flat(stream[:, :1]), offset(0)), decoder)
        replays = resumes(table, decoder, stream[:, :8])
        live = [table.submit(StreamRequest(9, 0, flat(stream[:, f:f + 1]), offset(f)), decoder) for f in range(1, 4)]
        await asyncio.gather(*replays, *live)
        # The replay steps in flight as one starts beside a live step.
        beside_live = [len(running - {9}) for cid, running in decoder.overlaps if cid != 9 and 9 in running]
        assert beside_live and set(beside_live) == {1}
        ends = [(index, cid) for index, (event, cid) in enumerate(decoder.events) if event == "end"]
        assert max(i for i, cid in ends if cid == 9) < max(i for i, cid in ends if cid != 9)

        quiet, decoder = make_table(decoder_max_frames_per_step=2), FakeDecoder(delays=delays)
        await asyncio.gather(*resumes(quiet, decoder, stream[:, :8]))
        assert max(len(running) for _, running in decoder.overlaps) == 4

    asyncio.run(scenario())
