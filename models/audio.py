"""Decoding uploaded audio for Whisper: any of WAV, FLAC, MP3, OGG (Opus/Vorbis) and WebM (Opus, what Chrome and
Firefox's MediaRecorder write) → 16 kHz mono float32, with PyAV (FFmpeg inside the wheel; no system FFmpeg).

Safety:
- the container is chosen from the file's first bytes (magic numbers) and handed to FFmpeg by name, so FFmpeg never
  probes other demuxers; anything else is "not audio" (415);
- an allowlist of codecs per container;
- limits (app/settings.py): channels, sample rates, and the decoded duration, counted *while* decoding: a tiny
  file that would decode to hours (a decoder bomb) is stopped as soon as it passes `max_audio_s`, so memory never
  holds more than that much audio;
- a file that declares a longer duration than it decodes to (cut off in transfer) is refused as truncated.
"""
from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RATE = 16000  # Whisper's sample rate
# container (FFmpeg demuxer name) → codecs accepted in it
CODECS = {
    "wav": {"pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le", "pcm_f64le", "pcm_u8", "pcm_alaw", "pcm_mulaw"},
    "flac": {"flac"},
    "mp3": {"mp3", "mp3float"},
    "ogg": {"opus", "vorbis", "flac"},
    "webm": {"opus", "vorbis"},
}
FORMAT_NAMES = {"wav": "wav", "flac": "flac", "mp3": "mp3", "ogg": "ogg", "webm": "webm"}
TRUNCATION_SLACK_S = 0.25  # decoded shorter than declared by more than this (and 10 %): truncated


class AudioInputError(ValueError):
    """Bad audio; `status` is the HTTP status the API answers with (400 unreadable, 413 too long, 415 not audio)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AudioLimits:
    max_seconds: float = 30.0  # Whisper's window
    max_channels: int = 8
    min_sample_rate: int = 8000
    max_sample_rate: int = 192000


@dataclass
class DecodedAudio:
    samples: np.ndarray  # (S,) float32 at 16 kHz, mono
    sample_rate: int  # the file's own rate
    channels: int  # the file's own channel count
    format: str  # "wav" | "flac" | "mp3" | "ogg" | "webm"

    @property
    def duration_s(self) -> float:
        return self.samples.size / RATE

    @property
    def nbytes(self) -> int:
        return self.samples.nbytes


def sniff_format(data: bytes) -> str | None:
    """The container from its magic number, or None (not a format we take)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska/WebM
        return "webm"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and (data[1] & 0xE0) == 0xE0):  # ID3 tag or MPEG sync
        return "mp3"
    return None


def decode_bytes(data: bytes, limits: AudioLimits = AudioLimits()) -> DecodedAudio:
    """Decode and resample to 16 kHz mono; AudioInputError (with its HTTP status) for anything wrong."""
    import av

    fmt = sniff_format(data)
    if fmt is None:
        raise AudioInputError("the file is not audio in a supported format (WAV, FLAC, MP3, OGG/Opus, WebM/Opus)", 415)
    demuxer = "matroska" if fmt == "webm" else fmt  # FFmpeg's demuxer for both Matroska and WebM
    try:
        container = av.open(io.BytesIO(data), mode="r", format=demuxer)
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise AudioInputError(f"the {fmt} file cannot be read: {exc}") from None
    with container:
        if not container.streams.audio:
            raise AudioInputError(f"the {fmt} file has no audio stream", 415)
        stream = container.streams.audio[0]
        codec = stream.codec_context.name
        if codec not in CODECS[fmt]:
            raise AudioInputError(f"codec {codec!r} in a {fmt} file is not accepted (accepted: {sorted(CODECS[fmt])})", 415)
        rate, channels = int(stream.codec_context.sample_rate or 0), int(stream.codec_context.channels or 0)
        if not limits.min_sample_rate <= rate <= limits.max_sample_rate:
            raise AudioInputError(f"sample rate {rate} Hz is outside {limits.min_sample_rate}–{limits.max_sample_rate} Hz "
                                  "(min_audio_sample_rate, max_audio_sample_rate)", 400)
        if not 1 <= channels <= limits.max_channels:
            raise AudioInputError(f"{channels} channels; at most {limits.max_channels} are accepted (max_audio_channels)", 400)
        declared = _wav_declared_seconds(data) if fmt == "wav" else _declared_seconds(container, stream)
        if declared is not None and declared > limits.max_seconds + 0.5:
            raise AudioInputError(_too_long(declared, limits), 413)
        samples = _decode_stream(container, stream, fmt, limits)
    if samples.size == 0:
        raise AudioInputError(f"the {fmt} file decodes to no audio")
    seconds = samples.size / RATE
    if declared is not None and declared - seconds > max(TRUNCATION_SLACK_S, 0.1 * declared):
        raise AudioInputError(f"the {fmt} file is truncated: it declares {declared:.2f} s but decodes to {seconds:.2f} s")
    return DecodedAudio(samples=samples, sample_rate=rate, channels=channels, format=FORMAT_NAMES[fmt])


def _too_long(seconds: float, limits: AudioLimits) -> str:
    return (f"the clip is longer than max_audio_s = {limits.max_seconds:g} s (Whisper's window){f' ({seconds:.1f} s)' if seconds else ''}; "
            "cut it to at most that")


def _wav_declared_seconds(data: bytes) -> float | None:
    """The duration a WAV header declares (data chunk size / byte rate): FFmpeg estimates a WAV's duration from the
    file's size, which hides a truncated file. None when the header leaves it open (a streamed WAV: size 0 or ~4 GB)."""
    import struct

    offset, byte_rate = 12, 0
    while offset + 8 <= len(data):
        chunk, size = data[offset:offset + 4], struct.unpack("<I", data[offset + 4:offset + 8])[0]
        if chunk == b"fmt " and offset + 16 <= len(data):
            byte_rate = struct.unpack("<I", data[offset + 16:offset + 20])[0]
        if chunk == b"data":
            if size == 0 or size >= 0x7FFF0000 or byte_rate == 0:
                return None
            return size / byte_rate
        offset += 8 + size + (size & 1)
    return None


def _declared_seconds(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def _decode_stream(container, stream, fmt: str, limits: AudioLimits) -> np.ndarray:
    """Decode, resampling as it goes, and stop once past the duration limit (the bomb guard)."""
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
    budget = int((limits.max_seconds + 0.5) * RATE)  # samples at 16 kHz; a little slack for codec padding
    parts: list[np.ndarray] = []
    total = 0
    try:
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                chunk = out.to_ndarray().reshape(-1)  # (n,) float32
                total += chunk.size
                if total > budget:
                    raise AudioInputError(_too_long(0.0, limits) + " (decoding stopped there)", 413)
                parts.append(chunk)
        for out in resampler.resample(None):  # flush
            chunk = out.to_ndarray().reshape(-1)
            total += chunk.size
            parts.append(chunk)
    except av.error.FFmpegError as exc:
        raise AudioInputError(f"the {fmt} file cannot be decoded: {exc}") from None
    if total > budget:
        raise AudioInputError(_too_long(total / RATE, limits), 413)
    return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)


def decode_path(path: str | Path, limits: AudioLimits = AudioLimits()) -> DecodedAudio:
    return decode_bytes(Path(path).read_bytes(), limits)


def to_wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    """16-bit PCM mono WAV of float samples in [-1, 1] (for playback in the browser)."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buffer.getvalue()
