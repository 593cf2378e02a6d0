"""Decoding uploaded audio for Whisper: any of WAV, FLAC, MP3, OGG (Opus/Vorbis) and WebM (Opus, what Chrome and
Firefox's MediaRecorder write) → 16 kHz mono float32, with PyAV (FFmpeg inside the wheel; no system FFmpeg).

Safety:
- the container is chosen from the file's first bytes (magic numbers) and handed to FFmpeg by name, so FFmpeg never
  probes other demuxers; anything else is "not audio" (415);
- an allowlist of codecs per container;
- limits (app/settings.py): channels, sample rates, and the decoded duration, counted *while* decoding: a tiny
  file that would decode to hours (a decoder bomb) is stopped as soon as it passes `max_audio_s`, so memory never
  holds more than that much audio;
- a file that declares a longer duration than it decodes to (cut off in transfer) is refused as truncated;
- a stream whose sample rate or channel layout changes part-way (a WebM from a recorder that switched inputs) is
  resampled segment by segment, each segment under the same limits; an MP3 whose rate changes (MP3s of other rates
  joined end to end) is refused (400 naming `file`): each joined file keeps its encoder delay and padding, and the
  times after the join would be off;
- whatever FFmpeg/PyAV raises on a damaged file ends as AudioInputError (400/413/415), never another exception:
  a stream FFmpeg has no decoder for (an unknown WAV format tag, a mangled Matroska CodecID) is 415, a header
  that cannot be decoded (a WAV with 0 bits per sample) or an inconsistent stream 400.
"""
from __future__ import annotations

import io
import logging
import struct
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
# WAVE format tags FFmpeg decodes to a codec of CODECS["wav"] (the 0xFFFE extensible header names one of these)
WAV_TAGS = {0x0001: "PCM", 0x0003: "IEEE float", 0x0006: "A-law", 0x0007: "µ-law", 0xFFFE: "extensible"}

log = logging.getLogger(__name__)


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
    if fmt == "wav" and (declared_channels := _wav_channels(data)) is not None and declared_channels > limits.max_channels:
        # FFmpeg reads a count it cannot lay out (65,535) as 0 channels: the header's own number is the one to name
        raise AudioInputError(f"the WAV header declares {declared_channels:,} channels; at most {limits.max_channels} "
                              "are accepted (max_audio_channels)", 400)
    cut = _ogg_cut(data) if fmt == "ogg" else _wav_overdeclared(data) if fmt == "wav" else None
    if cut is not None:  # FFmpeg decodes what is there and says nothing of what is missing
        raise AudioInputError(f"the {fmt} file is truncated or damaged: {cut}", 400)
    demuxer = "matroska" if fmt == "webm" else fmt  # FFmpeg's demuxer for both Matroska and WebM
    try:
        container = av.open(io.BytesIO(data), mode="r", format=demuxer)
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise AudioInputError(f"the {fmt} file cannot be read: {exc}") from None
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 — see _unexpected
        raise _unexpected(fmt, exc) from None
    try:
        with container:
            (rate, channels), declared, samples = _decode_container(container, data, fmt, limits)
    except (AudioInputError, MemoryError):
        raise
    except av.error.FFmpegError as exc:
        raise AudioInputError(f"the {fmt} file cannot be decoded: {exc}") from None
    except Exception as exc:  # noqa: BLE001 — see _unexpected
        raise _unexpected(fmt, exc) from None
    if samples.size == 0:
        raise AudioInputError(f"the {fmt} file decodes to no audio")
    seconds = samples.size / RATE
    if declared is not None and declared - seconds > max(TRUNCATION_SLACK_S, 0.1 * declared):
        raise AudioInputError(f"the {fmt} file is truncated: it declares {declared:.2f} s but decodes to {seconds:.2f} s")
    return DecodedAudio(samples=samples, sample_rate=rate, channels=channels, format=FORMAT_NAMES[fmt])


def _unexpected(fmt: str, exc: Exception) -> AudioInputError:
    """The safety net for what PyAV raises on a damaged file beyond the cases handled by name (none is known: the
    fuzz test, tests/unit/test_audio_decode_fuzz.py, checks it is never reached): a 400 rather than a 500, logged
    with its traceback so that a bug here stays visible."""
    log.warning("audio: %s file refused after an unexpected %s from PyAV", fmt, type(exc).__name__, exc_info=exc)
    return AudioInputError(f"the {fmt} file cannot be decoded (damaged or inconsistent stream: {type(exc).__name__}: {exc})")


def _decode_container(container, data: bytes, fmt: str, limits: AudioLimits):
    """((rate, channels), declared seconds or None, samples) of the first audio stream, with every check."""
    if not container.streams.audio:
        raise AudioInputError(f"the {fmt} file has no audio stream", 415)
    stream = container.streams.audio[0]
    if stream.codec_context is None:  # FFmpeg found no decoder for the stream's codec id
        raise _no_decoder(data, fmt)
    codec = stream.codec_context.name
    if codec not in CODECS[fmt]:
        raise AudioInputError(f"codec {codec!r} in a {fmt} file is not accepted (accepted: {sorted(CODECS[fmt])})", 415)
    rate, channels = int(stream.codec_context.sample_rate or 0), int(stream.codec_context.channels or 0)
    _check_shape(rate, channels, limits)
    declared = _wav_declared_seconds(data) if fmt == "wav" else _declared_seconds(container, stream)
    # An MP3's declared duration is FFmpeg's estimate from its first frame's bit rate (or its first file's Xing
    # header): joined MP3s of other rates or bit rates are nothing like it (8 kHz then 44.1 kHz, 6.7 s, was
    # "52.6 s"). An MP3 is measured by decoding it, which stops once past max_audio_s.
    if declared is not None and declared > limits.max_seconds + 0.5 and fmt != "mp3":
        raise AudioInputError(_too_long(declared, limits), 413)
    samples, first, segments = _decode_stream(container, stream, fmt, limits)
    if fmt == "mp3" and segments > 1:
        declared = None  # the estimate described the first segment only: no truncation check against it
    # a stream that changes part-way is described by its first segment (FFmpeg's header may already name a later one)
    return (first[3], first[2]) if first else (rate, channels), declared, samples


def _check_shape(rate: int, channels: int, limits: AudioLimits, where: str = "") -> None:
    if not limits.min_sample_rate <= rate <= limits.max_sample_rate:
        raise AudioInputError(f"sample rate {rate} Hz{where} is outside {limits.min_sample_rate}–{limits.max_sample_rate} Hz "
                              "(min_audio_sample_rate, max_audio_sample_rate)", 400)
    if channels < 1:
        raise AudioInputError(f"the stream declares {channels} channels{where}: the file is damaged", 400)
    if channels > limits.max_channels:
        raise AudioInputError(f"{channels} channels{where}; at most {limits.max_channels} are accepted (max_audio_channels)", 400)


def _no_decoder(data: bytes, fmt: str) -> AudioInputError:
    """Why FFmpeg has no decoder for the stream: for a WAV, read from its fmt chunk (an unknown format tag is a
    format we do not decode, 415; a known tag with 0 bits per sample a damaged header, 400)."""
    if fmt == "wav":
        header = _wav_fmt(data)
        if header is not None:
            tag, bits = header
            if tag not in WAV_TAGS:
                return AudioInputError(f"WAV format tag 0x{tag:04X} is not one we decode (accepted: "
                                       + ", ".join(f"0x{t:04X} {n}" for t, n in WAV_TAGS.items()) + ")", 415)
            if bits == 0:
                return AudioInputError(f"the WAV header ({WAV_TAGS[tag]}) declares bits_per_sample 0: the file is damaged")
            return AudioInputError(f"the WAV header ({WAV_TAGS[tag]}, bits_per_sample {bits}) names no sample format "
                                   "FFmpeg decodes", 415)
    return AudioInputError(f"the {fmt} file's audio codec is unknown to FFmpeg (damaged, or not a codec we decode; "
                           f"accepted: {sorted(CODECS[fmt])})", 415)


def _wav_fmt(data: bytes) -> tuple[int, int] | None:
    """(format tag, bits per sample) of a WAV's fmt chunk; the extensible header's sub-format tag in its place."""
    offset = 12
    while offset + 8 <= len(data):
        chunk, size = data[offset:offset + 4], struct.unpack("<I", data[offset + 4:offset + 8])[0]
        body = data[offset + 8:offset + 8 + size]
        if chunk == b"fmt ":
            if len(body) < 16:
                return None
            tag, bits = struct.unpack("<H", body[0:2])[0], struct.unpack("<H", body[14:16])[0]
            if tag == 0xFFFE and len(body) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the sub-format GUID starts with the tag
                sub = struct.unpack("<H", body[24:26])[0]
                tag = sub if sub in WAV_TAGS else 0x10000 + sub  # unknown sub-formats stay unknown
            return tag, bits
        offset += 8 + size + (size & 1)
    return None


def _wav_channels(data: bytes) -> int | None:
    """The channel count a WAV's fmt chunk declares (None without one)."""
    offset = 12
    while offset + 8 <= len(data):
        chunk, size = data[offset:offset + 4], struct.unpack("<I", data[offset + 4:offset + 8])[0]
        if chunk == b"fmt ":
            return struct.unpack("<H", data[offset + 10:offset + 12])[0] if offset + 12 <= len(data) else None
        offset += 8 + size + (size & 1)
    return None


def _ogg_cut(data: bytes) -> str | None:
    """Why an Ogg file is cut short, or None. Its pages (RFC 3533 §6: "OggS", flags at byte 5, the stream's serial at
    14, the segment count at 26, then the segment table and the body) are walked: the last one must be whole, and each
    logical stream must end with a page flagged end-of-stream (0x04), which every writer sets when it finishes (a
    browser's MediaRecorder when it stops; FFmpeg; libogg). Bytes that are not a page stop the walk (FFmpeg judges
    those)."""
    offset, streams, ended = 0, set(), set()
    while offset < len(data):
        if data[offset:offset + 4] != b"OggS":
            return None
        if offset + 27 > len(data):
            return f"it ends inside the header of the page at byte {offset:,}"
        flags, serial, segments = data[offset + 5], data[offset + 14:offset + 18], data[offset + 26]
        table_end = offset + 27 + segments
        end = table_end + sum(data[offset + 27:table_end])
        if table_end > len(data) or end > len(data):
            return (f"the page at byte {offset:,} needs {end - offset:,} bytes and the file has {len(data) - offset:,} "
                    "left")
        streams.add(serial)
        if flags & 0x04:
            ended.add(serial)
        offset = end
    if streams - ended:
        return f"it ends after {len(data):,} bytes without its end-of-stream page (the rest of the recording is missing)"
    return None


def _wav_overdeclared(data: bytes) -> str | None:
    """Why a WAV's sizes cannot be its own, or None: a RIFF size or a data chunk declaring more bytes than the file
    holds (0xFFFFFFF0 for a 4 kB file). 0 and 0xFFFFFFFF are the streamed-WAV marks ("size unknown") and pass, as a
    few bytes of slack do (writers that count the pad byte or the header)."""
    slack = 16
    riff = struct.unpack("<I", data[4:8])[0]
    if riff not in (0, 0xFFFFFFFF) and riff + 8 > len(data) + slack:
        return f"its RIFF header declares {riff:,} bytes and the file has {len(data) - 8:,} after it"
    offset = 12
    while offset + 8 <= len(data):
        chunk, size = data[offset:offset + 4], struct.unpack("<I", data[offset + 4:offset + 8])[0]
        if chunk == b"data":
            left = len(data) - offset - 8
            if size not in (0, 0xFFFFFFFF) and size > left + slack:
                return f"its data chunk declares {size:,} bytes of samples and the file has {left:,} after it"
            return None
        offset += 8 + size + (size & 1)
    return None


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


def _decode_stream(container, stream, fmt: str, limits: AudioLimits) -> tuple[np.ndarray, tuple | None, int]:
    """Decode, resampling as it goes, and stop once past the duration limit (the bomb guard). A resampler takes one
    input format/layout/rate: where the stream changes them, the segment so far is flushed and a new one set up.
    Answers the samples, the first segment's (format, layout, channels, rate) (None when nothing decoded) and the
    number of segments."""
    import av

    budget = int((limits.max_seconds + 0.5) * RATE)  # samples at 16 kHz; a little slack for codec padding
    parts: list[np.ndarray] = []
    total = 0
    resampler, shape, first, segments = None, None, None, 0

    def take(frames) -> None:
        nonlocal total
        for out in frames:
            chunk = out.to_ndarray().reshape(-1)  # (n,) float32
            total += chunk.size
            if total > budget:
                raise AudioInputError(_too_long(0.0, limits) + " (decoding stopped there)", 413)
            parts.append(chunk)

    for frame in (_mp3_frames(container, stream) if fmt == "mp3" else container.decode(stream)):
        frame_shape = (frame.format.name, frame.layout.name, frame.layout.nb_channels, int(frame.sample_rate or 0))
        if frame_shape != shape:
            if resampler is not None:
                take(resampler.resample(None))  # the previous segment's tail
            _check_shape(frame_shape[3], frame_shape[2], limits, f" (from {total / RATE:.2f} s on)" if shape else "")
            resampler, shape = av.AudioResampler(format="flt", layout="mono", rate=RATE), frame_shape
            first, segments = first or frame_shape, segments + 1
        take(resampler.resample(frame))
    if resampler is not None:
        take(resampler.resample(None))  # flush
    samples = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)
    return samples, first, segments


# MPEG audio header: version bits → the sample rates of its 2-bit index (MPEG-1, MPEG-2, MPEG-2.5)
MPEG_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _mpeg_rate(packet: bytes) -> int | None:
    """The sample rate an MPEG audio frame's 4-byte header names, None when it is not a valid header."""
    if len(packet) < 4 or packet[0] != 0xFF or (packet[1] & 0xE0) != 0xE0:
        return None
    rates, index = MPEG_RATES.get((packet[1] >> 3) & 3), (packet[2] >> 2) & 3
    return rates[index] if rates is not None and index < 3 else None


def _mp3_frames(container, stream):
    """Decoded MP3 frames, each labelled with the sample rate of its own packet's header. FFmpeg's MP3 decoder stamps
    a frame with the rate of the frame before (it updates the rate after allocating the frame), so where the rate
    changes part-way (two MP3s joined) one frame would be resampled at the wrong rate; MP3 has no decoder delay, so
    a packet's frames are its own."""
    first_rate, decoded = None, 0
    for packet in container.demux(stream):
        raw = bytes(packet) if packet.size else b""
        rate = _mpeg_rate(raw) if raw else None
        if rate is None and raw[:3] in (b"ID3", b"TAG"):
            continue  # a tag between joined MP3s (the next file's ID3v2, the last one's ID3v1): not audio (FFmpeg: 400)
        if rate is not None and first_rate is not None and rate != first_rate:
            raise AudioInputError(_rate_change(first_rate, rate, decoded / first_rate), 400)
        first_rate = first_rate or rate
        for frame in packet.decode():
            decoded += frame.samples if rate in (None, first_rate) else 0
            if rate is not None and frame.sample_rate != rate:
                frame.sample_rate = rate
            yield frame


def _rate_change(first: int, then: int, at_s: float) -> str:
    """Why an MP3 whose sample rate changes part-way is refused: joined files keep each one's encoder delay and
    padding (which a file decoded alone has trimmed: its Xing/LAME header), so every time after the join would be off
    by about 0.1 s against the parts; word times must be true."""
    return (f"this MP3's sample rate changes part-way ({first:,} Hz, then {then:,} Hz from {at_s:.2f} s on: MP3s "
            "of other rates joined end to end), so the times after the join would not be true; convert it to one "
            "rate (e.g. `ffmpeg -i in.mp3 -ar 44100 out.mp3`) and upload it again")


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
