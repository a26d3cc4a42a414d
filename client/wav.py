"""WAV files with numpy alone (the stdlib `wave` writes integer PCM only): writes IEEE float32 and 16-bit
PCM; reads 8/16/24/32-bit PCM and 32/64-bit float, plain or WAVE_FORMAT_EXTENSIBLE."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WAVE_FORMAT_PCM = 1
WAVE_FORMAT_IEEE_FLOAT = 3
WAVE_FORMAT_EXTENSIBLE = 0xFFFE
SAMPLE_FORMATS = ("float32", "int16")
INT16_FULL_SCALE = 32767


class WavError(ValueError):
    pass


@dataclass
class WavData:
    samples: np.ndarray  # [frames, channels] as stored: float32/float64/int16/int32/uint8
    sample_rate_hz: int
    sample_format: str  # "float32", "float64", "int8" (unsigned 8-bit), "int16", "int24", "int32"

    channels = property(lambda self: self.samples.shape[1])

    def to_float32_mono(self) -> np.ndarray:
        """Samples as float32 in [-1, 1], channels averaged: [frames]."""
        scaled = self.samples.astype(np.float32)
        if self.sample_format == "int8":
            scaled = (scaled - 128.0) / 128.0
        elif self.sample_format.startswith("int"):
            scaled /= float(2 ** (int(self.sample_format[3:]) - 1))
        return scaled.mean(axis=1, dtype=np.float32) if scaled.shape[1] > 1 else scaled[:, 0]


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate_hz: int, sample_format: str = "float32") -> None:
    """Write mono PCM [samples]: float32 as given, or int16 clipped to [-1, 1] (else values would wrap around)."""
    if sample_format not in SAMPLE_FORMATS:
        raise ValueError(f"sample_format must be one of {SAMPLE_FORMATS}, got {sample_format!r}")
    pcm = np.asarray(pcm)
    if pcm.ndim != 1:
        raise ValueError(f"pcm must be 1-D (mono), got shape {pcm.shape}")
    if sample_format == "float32":
        data, format_tag, sample_bytes = np.ascontiguousarray(pcm, dtype="<f4").tobytes(), WAVE_FORMAT_IEEE_FLOAT, 4
    else:
        int16 = np.round(np.clip(pcm.astype(np.float32), -1.0, 1.0) * INT16_FULL_SCALE).astype("<i2")
        data, format_tag, sample_bytes = int16.tobytes(), WAVE_FORMAT_PCM, 2
    fmt = struct.pack("<HHIIHH", format_tag, 1, sample_rate_hz, sample_rate_hz * sample_bytes, sample_bytes,
                      8 * sample_bytes)
    chunks = [b"fmt ", struct.pack("<I", len(fmt)), fmt]
    if format_tag != WAVE_FORMAT_PCM:  # the `fact` chunk non-PCM formats require
        chunks += [b"fact", struct.pack("<II", 4, len(pcm))]
    chunks += [b"data", struct.pack("<I", len(data)), data, b"\0" * (len(data) % 2)]  # RIFF chunks are word-aligned
    body = b"WAVE" + b"".join(chunks)
    Path(path).write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def read_wav(path: str | Path) -> WavData:
    blob = Path(path).read_bytes()
    if len(blob) < 12 or blob[:4] != b"RIFF" or blob[8:12] != b"WAVE":
        raise WavError(f"{path}: not a RIFF/WAVE file")
    chunks, position = {}, 12
    while position + 8 <= len(blob):
        chunk_id, size = blob[position : position + 4], struct.unpack("<I", blob[position + 4 : position + 8])[0]
        chunks.setdefault(chunk_id, blob[position + 8 : position + 8 + size])
        position += 8 + size + (size % 2)
    if b"fmt " not in chunks or b"data" not in chunks:
        raise WavError(f"{path}: no fmt or data chunk")
    fmt = chunks[b"fmt "]
    if len(fmt) < 16:
        raise WavError(f"{path}: fmt chunk too short ({len(fmt)} bytes)")
    format_tag, channels, sample_rate_hz, _, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if format_tag == WAVE_FORMAT_EXTENSIBLE:
        if len(fmt) < 40:
            raise WavError(f"{path}: WAVE_FORMAT_EXTENSIBLE fmt chunk too short")
        format_tag = struct.unpack("<H", fmt[24:26])[0]  # first two bytes of the sub-format GUID
    if channels < 1 or block_align != channels * (bits // 8):
        raise WavError(f"{path}: inconsistent fmt chunk ({channels} channels, {bits} bits, block {block_align})")
    data = chunks[b"data"][: len(chunks[b"data"]) - len(chunks[b"data"]) % block_align]
    if format_tag == WAVE_FORMAT_IEEE_FLOAT and bits in (32, 64):
        sample_format, samples = f"float{bits}", np.frombuffer(data, dtype=f"<f{bits // 8}")
    elif format_tag == WAVE_FORMAT_PCM and bits in (8, 16, 32):
        sample_format, samples = f"int{bits}", np.frombuffer(data, dtype={8: "u1", 16: "<i2", 32: "<i4"}[bits])
    elif format_tag == WAVE_FORMAT_PCM and bits == 24:
        sample_format = "int24"
        triplets = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        samples = (triplets[:, 0] | (triplets[:, 1] << 8) | (triplets[:, 2] << 16)) << 8 >> 8
    else:
        raise WavError(f"{path}: unsupported WAV format (tag {format_tag}, {bits} bits)")
    return WavData(samples.reshape(-1, channels), sample_rate_hz, sample_format)
