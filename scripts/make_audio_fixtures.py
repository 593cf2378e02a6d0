"""The audio test fixtures under tests/fixtures/audio/ (each a few KB, committed), encoded with PyAV (FFmpeg's
encoders inside the wheel; no system FFmpeg):

    .venv/bin/python scripts/make_audio_fixtures.py

Valid clips, the seeds of the decoding fuzz test (tests/unit/test_audio_decode_fuzz.py):
    tone.wav (16-bit PCM, 8 kHz), tone.mp3 (16 kHz, no ID3 tag), tone.webm and tone.ogg (Opus), tone.flac.
Inputs an outside probe found answered with 500 before (tests/api/test_audio_bad_uploads.py):
    rate_change.mp3            a 44.1 kHz MP3 followed by an 8 kHz one (no ID3 tags): the sample rate changes
                               mid-stream (decoded segment by segment: 200);
    channels_change.mp3        a mono MP3 followed by a stereo one at the same rate (200 likewise);
    unknown_format_tag.wav     a WAV whose fmt chunk names format tag 0x1234, which FFmpeg has no decoder for (415);
    zero_bits_per_sample.wav   a PCM WAV declaring bits_per_sample 0 (400);
    flipped_codec_id.webm      a WebM/Opus with one bit flipped in its CodecID ("A_OPUS" → "A_OPUR") (415).
Inputs accepted before although damaged (issue 53 §12):
    truncated.ogg              tone.ogg cut to 700 bytes, inside its audio page (400);
    overdeclared.wav           tone.wav whose data chunk declares 0xFFFFFFF0 bytes (400).

The output is the same on every run (the muxers are told to be bit-exact), so regenerating changes no file.
"""
from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "audio"


def tone(seconds: float, rate: int, channels: int = 1, hz: float = 440.0) -> np.ndarray:
    """A sine with a 3 Hz tremolo, int16 (channels, samples)."""
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.4 * np.sin(2 * np.pi * hz * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    return np.repeat((wave * 32767).astype(np.int16)[None, :], channels, axis=0)


def encode(samples: np.ndarray, rate: int, container: str, codec: str, bit_rate: int | None = None,
           options: dict[str, str] | None = None) -> bytes:
    """int16 (channels, n) samples at `rate` → `container`/`codec` bytes, at the same rate."""
    import av

    channels = samples.shape[0]
    layout = {1: "mono", 2: "stereo"}[channels]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container, options={"fflags": "+bitexact", **(options or {})}) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        if bit_rate:
            stream.bit_rate = bit_rate
        stream.codec_context.flags |= av.codec.context.Flags.bitexact
        frame = av.AudioFrame.from_ndarray(samples.T.reshape(1, -1).copy(), format="s16", layout=layout)
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout=layout, rate=rate)
        for chunk in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(chunk):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buffer.getvalue()


def bare_mp3(samples: np.ndarray, rate: int) -> bytes:
    """An MP3 of bare MPEG frames (no ID3v2/ID3v1 tag, no Xing header), so two can be joined into one stream."""
    return encode(samples, rate, "mp3", "libmp3lame", bit_rate=32000,
                  options={"id3v2_version": "0", "write_id3v1": "0", "write_xing": "0"})


def wav_fmt_offset(data: bytes) -> int:
    """Where the fmt chunk's body starts in a RIFF/WAVE file."""
    offset = 12
    while offset + 8 <= len(data):
        size = struct.unpack("<I", data[offset + 4:offset + 8])[0]
        if data[offset:offset + 4] == b"fmt ":
            return offset + 8
        offset += 8 + size + (size & 1)
    raise ValueError("no fmt chunk")


def flac_without_padding(data: bytes) -> bytes:
    """FFmpeg's FLAC muxer reserves an 8 KB PADDING metadata block; drop it (and mark the block before it last)."""
    blocks, offset = [], 4
    while True:
        header = data[offset]
        size = int.from_bytes(data[offset + 1:offset + 4], "big")
        blocks.append(bytearray(data[offset:offset + 4 + size]))
        offset += 4 + size
        if header & 0x80:
            break
    kept = [b for b in blocks if b[0] & 0x7F != 1]  # type 1: PADDING
    for block in kept:
        block[0] &= 0x7F
    kept[-1][0] |= 0x80
    return data[:4] + b"".join(kept) + data[offset:]


def fixtures() -> dict[str, bytes]:
    wav = encode(tone(0.25, 8000), 8000, "wav", "pcm_s16le")
    fmt = wav_fmt_offset(wav)
    unknown_tag = wav[:fmt] + struct.pack("<H", 0x1234) + wav[fmt + 2:]  # wFormatTag
    zero_bits = wav[:fmt + 14] + struct.pack("<H", 0) + wav[fmt + 16:]  # wBitsPerSample
    webm = encode(tone(0.5, 48000), 48000, "webm", "libopus", bit_rate=16000)
    at = webm.index(b"A_OPUS") + 5
    flipped = webm[:at] + bytes([webm[at] ^ 0x01]) + webm[at + 1:]  # "A_OPUS" → "A_OPUR": no such codec
    ogg = encode(tone(0.5, 48000), 48000, "ogg", "libopus", bit_rate=16000)
    data_size = wav.index(b"data") + 4
    return {
        "tone.wav": wav,
        "tone.mp3": bare_mp3(tone(0.5, 16000), 16000),
        "tone.webm": webm,
        "tone.ogg": ogg,
        "tone.flac": flac_without_padding(encode(tone(0.25, 8000), 8000, "flac", "flac")),
        # 440 Hz at 44.1 kHz, then 1 kHz at 8 kHz: each half keeps its pitch only if resampled at its own rate
        "rate_change.mp3": bare_mp3(tone(0.5, 44100), 44100) + bare_mp3(tone(0.5, 8000, hz=1000.0), 8000),
        "channels_change.mp3": bare_mp3(tone(0.5, 44100), 44100) + bare_mp3(tone(0.5, 44100, channels=2), 44100),
        "unknown_format_tag.wav": unknown_tag,
        "zero_bits_per_sample.wav": zero_bits,
        "flipped_codec_id.webm": flipped,
        "truncated.ogg": ogg[:700],
        "overdeclared.wav": wav[:data_size] + struct.pack("<I", 0xFFFFFFF0) + wav[data_size + 4:],
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, data in fixtures().items():
        (OUT / name).write_bytes(data)
        print(f"{name:28s} {len(data):6,d} bytes")


if __name__ == "__main__":
    main()
