"""models/audio.py on damaged and inconsistent input (issue 27, part 6): the inputs an outside probe found answered
with 500 (a sample rate or channel count that changes mid-stream, a WAV FFmpeg has no decoder for, byte-flipped
WebM), kept as files in tests/fixtures/audio/ (made by scripts/make_audio_fixtures.py), and a seeded, bounded fuzz
over mutants of the valid clips there: decoding either succeeds or raises AudioInputError (400/413/415) from one of
the module's named checks, never another exception and never its catch-all."""
from __future__ import annotations

import logging
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from models.audio import RATE, AudioInputError, AudioLimits, decode_bytes

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"
SEEDS = ["tone.wav", "tone.mp3", "tone.webm", "tone.ogg", "tone.flac"]
MUTANTS_PER_SEED = 120  # 600 in all: about a second
CATCH_ALL = "damaged or inconsistent stream"  # the message of models/audio.py's last-resort refusal


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def pitch(samples: np.ndarray) -> float:
    """The strongest frequency (Hz) of 16 kHz samples."""
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / RATE)[spectrum.argmax()])


# ---- the probe's inputs ----------------------------------------------------------------------------------------
def test_the_seeds_decode():
    for name in SEEDS:
        audio = decode_bytes(fixture(name))
        assert audio.format == name.split(".")[1] and 0.2 < audio.duration_s < 0.7, name
        assert 0.1 < float(np.sqrt(np.mean(audio.samples**2))) < 0.35, name  # the tone, not silence or noise


def test_a_sample_rate_change_mid_stream_of_an_mp3_is_refused_naming_the_rates():
    """44.1 kHz (440 Hz) then 8 kHz (1 kHz), two MP3s joined: a 400 naming both rates and where the rate changes
    (issue 56 §11: joined files keep each one's encoder delay and padding, so the times after the join would be off);
    each half decodes alone, at its own rate and pitch."""
    joined = fixture("rate_change.mp3")
    cut = joined.index(b"\xff\xe3", 1000)  # the first MPEG-2.5 (8 kHz) frame header
    first, second = decode_bytes(joined[:cut]), decode_bytes(joined[cut:])
    assert (first.sample_rate, second.sample_rate) == (44100, 8000)
    assert abs(pitch(first.samples[1600:-1600]) - 440) < 10 and abs(pitch(second.samples[1600:-1600]) - 1000) < 10
    with pytest.raises(AudioInputError, match="44,100 Hz, then 8,000 Hz") as caught:
        decode_bytes(joined)
    assert caught.value.status == 400


def test_a_channel_change_mid_stream_is_mixed_segment_by_segment():
    audio = decode_bytes(fixture("channels_change.mp3"))
    assert audio.channels == 1 and audio.sample_rate == 44100
    assert abs(audio.duration_s - 2 * 0.5486) < 0.01  # two 0.5 s MP3s of 44.1 kHz (with the encoder's padding)
    # the stereo half is mixed down as FFmpeg's `-ac 1` does (each channel × 1/√2, what Whisper's own loader uses):
    # its two equal channels come out √2 louder than the mono half; a segment left unmixed or mixed with the mono
    # half's setup would not
    n = audio.samples.size // 2
    rms = [float(np.sqrt(np.mean(part**2))) for part in (audio.samples[:n], audio.samples[n:])]
    assert abs(rms[1] / rms[0] - np.sqrt(2)) < 0.05, rms


def test_a_segment_outside_the_limits_is_400_naming_when():
    import io

    import av

    def mp3(seconds: float, rate: int) -> bytes:  # the fixture script's bare MP3 (no ID3), long enough that FFmpeg's
        from scripts.make_audio_fixtures import bare_mp3, tone  # probe sees only the first segment

        return bare_mp3(tone(seconds, rate), rate)

    data = mp3(2.0, 44100) + mp3(0.5, 8000)
    with av.open(io.BytesIO(data), format="mp3") as probe:
        assert probe.streams.audio[0].codec_context.sample_rate == 44100  # the header check passes: the segment's is hit
    # an MP3's rate change is refused as such before its segment's rate is checked (issue 56 §11): still a 400
    # naming when the 8 kHz part begins
    with pytest.raises(AudioInputError, match=r"then 8,000 Hz from 2\.\d\d s on") as caught:
        decode_bytes(data, AudioLimits(min_sample_rate=16000))
    assert caught.value.status == 400


@pytest.mark.parametrize("name,status,words", [
    ("unknown_format_tag.wav", 415, "WAV format tag 0x1234 is not one we decode"),
    ("zero_bits_per_sample.wav", 400, "bits_per_sample 0"),
    ("flipped_codec_id.webm", 415, "audio codec is unknown"),
])
def test_streams_without_a_decoder_are_refused_by_name(name, status, words):
    """FFmpeg opens these but has no decoder (stream.codec_context is None): was AttributeError."""
    with pytest.raises(AudioInputError, match=words) as caught:
        decode_bytes(fixture(name))
    assert caught.value.status == status


def test_an_unexpected_pyav_error_is_400_and_logged(monkeypatch, caplog):
    """The safety net: whatever else PyAV raises on a file is a 400 naming the file's format, logged with its
    traceback (a bug in this module would show there)."""
    import av

    def broken(self, frame):
        raise RuntimeError("something PyAV never raised before")

    monkeypatch.setattr(av.AudioResampler, "resample", broken)
    with caplog.at_level(logging.WARNING, logger="models.audio"), pytest.raises(AudioInputError) as caught:
        decode_bytes(fixture("tone.wav"))
    assert caught.value.status == 400 and "wav file cannot be decoded" in str(caught.value)
    assert "RuntimeError" in str(caught.value) and any(r.exc_info for r in caplog.records)


# ---- the fuzz ------------------------------------------------------------------------------------------------------
def _wav_fields(data: bytes) -> dict[str, tuple[int, str]]:
    """Offsets and struct formats of a WAV's header fields."""
    fields = {"riff_size": (4, "<I")}
    offset = 12
    while offset + 8 <= len(data):
        size = struct.unpack("<I", data[offset + 4:offset + 8])[0]
        if data[offset:offset + 4] == b"fmt ":
            body = offset + 8
            fields.update(format_tag=(body, "<H"), channels=(body + 2, "<H"), sample_rate=(body + 4, "<I"),
                          byte_rate=(body + 8, "<I"), block_align=(body + 12, "<H"), bits_per_sample=(body + 14, "<H"))
        if data[offset:offset + 4] == b"data":
            fields["data_size"] = (offset + 4, "<I")
        offset += 8 + size + (size & 1)
    return fields


def _header_change(rng: random.Random, name: str, data: bytearray) -> str:
    if name.endswith(".wav"):
        field, (at, fmt) = rng.choice(sorted(_wav_fields(bytes(data)).items()))
        top = 0xFFFF if fmt == "<H" else 0xFFFFFFFF
        value = rng.choice([0, 1, 2, 3, 7, 8, 0xFFFE, top, rng.randrange(top + 1)]) & top
        data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
        return f"{field}={value}"
    if name.endswith(".mp3"):  # the version, layer, bitrate, rate and channel-mode bits of a frame header
        frames = [i for i in range(len(data) - 4) if data[i] == 0xFF and data[i + 1] & 0xE0 == 0xE0]
        at = rng.choice(frames[:8]) + rng.randrange(1, 4)
        data[at] = rng.randrange(256)
        return f"mpeg header byte {at}={data[at]}"
    at = rng.randrange(min(96, len(data)))  # Ogg page header / EBML header and track entry
    data[at] = rng.choice([0, 0xFF, rng.randrange(256)])
    return f"byte {at}={data[at]}"


def mutants(seed: int = 27):
    """(description, bytes): MUTANTS_PER_SEED mutants of each seed clip, from one seeded generator."""
    rng = random.Random(seed)
    clips = {name: fixture(name) for name in SEEDS}
    for name, clip in clips.items():
        for i in range(MUTANTS_PER_SEED):
            data = bytearray(clip)
            kind = rng.choice(["flip", "flip", "header", "header", "truncate", "zeros", "splice", "repeat"])
            if kind == "flip":
                spots = [(rng.randrange(len(data)), rng.randrange(8)) for _ in range(rng.randint(1, 8))]
                for at, bit in spots:
                    data[at] ^= 1 << bit
                what = f"bits {spots}"
            elif kind == "header":
                what = _header_change(rng, name, data)
            elif kind == "truncate":
                end = rng.randrange(4, len(data))
                data, what = data[:end], f"first {end} bytes"
            elif kind == "zeros":
                at, n = rng.randrange(len(data)), rng.randint(1, 256)
                data[at:at + n] = bytes(len(data[at:at + n]))
                what = f"{n} zeros at {at}"
            elif kind == "splice":  # another clip's bytes inside this one (another format, another rate)
                other = clips[rng.choice(SEEDS)]
                at, start = rng.randrange(len(data)), rng.randrange(len(other))
                piece = other[start:start + rng.randint(16, 2048)]
                data[at:at] = piece
                what = f"{len(piece)} bytes of another clip at {at}"
            else:  # a slice again (a stream that restarts)
                start = rng.randrange(len(data))
                end = min(len(data), start + rng.randint(16, 4096))
                data[end:end] = data[start:end]
                what = f"bytes {start}:{end} repeated"
            yield f"{name} #{i}: {kind} {what}", bytes(data)


def test_mutants_decode_or_are_refused_by_a_named_check(caplog):
    limits = AudioLimits(max_seconds=10.0)
    outcomes: dict[str, int] = {}
    with caplog.at_level(logging.WARNING, logger="models.audio"):
        for what, data in mutants():
            try:
                audio = decode_bytes(data, limits)
            except AudioInputError as exc:
                message = str(exc)
                assert exc.status in (400, 413, 415) and message, what
                assert CATCH_ALL not in message, f"{what}: refused only by the catch-all: {message}"
                outcomes[str(exc.status)] = outcomes.get(str(exc.status), 0) + 1
            except Exception as exc:  # noqa: BLE001 — what the test is about
                pytest.fail(f"{what}: {type(exc).__name__}: {exc}")
            else:
                assert audio.samples.dtype == np.float32 and audio.samples.ndim == 1, what
                assert np.isfinite(audio.samples).all() and audio.samples.size > 0, what
                assert audio.duration_s <= limits.max_seconds + 0.5, what
                assert limits.min_sample_rate <= audio.sample_rate <= limits.max_sample_rate, what
                assert 1 <= audio.channels <= limits.max_channels, what
                outcomes["ok"] = outcomes.get("ok", 0) + 1
    assert sum(outcomes.values()) == len(SEEDS) * MUTANTS_PER_SEED
    assert outcomes.get("ok", 0) > 50 and outcomes.get("400", 0) > 50 and outcomes.get("415", 0) > 5, outcomes
    assert not [r for r in caplog.records if r.exc_info], "the catch-all was reached"
