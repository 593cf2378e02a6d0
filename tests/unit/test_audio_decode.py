"""models/audio.py: every accepted container decodes to the same 16 kHz mono clip length, and bad input is refused
with the right status (not audio 415, unreadable/truncated 400, too long or a decoder bomb 413 while decoding).
The files are encoded here with PyAV itself (FFmpeg's encoders inside the wheel)."""
from __future__ import annotations

import io
import struct

import numpy as np
import pytest

from models.audio import AudioInputError, AudioLimits, decode_bytes, sniff_format, to_wav

RATE = 16000


def tone(seconds: float, rate: int = RATE, channels: int = 1) -> np.ndarray:
    """A 440 Hz tone with a 3 Hz tremolo, int16 (channels, samples)."""
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.4 * np.sin(2 * np.pi * 440 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    return np.repeat((wave * 32767).astype(np.int16)[None, :], channels, axis=0)


def encode(samples: np.ndarray, rate: int, container: str, codec: str, out_rate: int | None = None) -> bytes:
    """Encode int16 (channels, n) samples with PyAV into `container`/`codec`."""
    import av

    channels = samples.shape[0]
    layout = {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=out_rate or rate, layout=layout)
        interleaved = samples.T.reshape(1, -1).copy()  # packed s16: (1, n · channels)
        frame = av.AudioFrame.from_ndarray(interleaved, format="s16", layout=layout)
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout=layout, rate=out_rate or rate)
        for chunk in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(chunk):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buffer.getvalue()


FORMATS = [  # (container, codec, the file's sample rate) as browsers and tools write them
    ("wav", "pcm_s16le", 22050),
    ("flac", "flac", 44100),
    ("mp3", "libmp3lame", 44100),
    ("ogg", "libopus", 48000),
    ("webm", "libopus", 48000),
]


@pytest.mark.parametrize("container,codec,rate", FORMATS)
def test_every_format_decodes_to_the_same_duration(container, codec, rate):
    seconds = 3.3
    data = encode(tone(seconds, RATE), RATE, container, codec, out_rate=rate)
    audio = decode_bytes(data)
    assert audio.format == container and audio.sample_rate == rate and audio.channels == 1
    assert audio.samples.dtype == np.float32 and audio.samples.ndim == 1
    assert abs(audio.duration_s - seconds) <= 0.1, (container, audio.duration_s)
    # the same signal: its loudness survives the codecs (RMS of 0.4·sin·(0.6…1) ≈ 0.22)
    assert 0.15 < float(np.sqrt(np.mean(audio.samples**2))) < 0.3


def test_stereo_is_mixed_to_mono():
    audio = decode_bytes(encode(tone(1.0, RATE, channels=2), RATE, "wav", "pcm_s16le"))
    assert audio.channels == 2 and abs(audio.duration_s - 1.0) < 0.01


def test_not_audio_is_415():
    for data in (b"hello, this is text", b"\x89PNG\r\n\x1a\n" + bytes(100), b"%PDF-1.7\n"):
        with pytest.raises(AudioInputError) as caught:
            decode_bytes(data)
        assert caught.value.status == 415
    assert sniff_format(b"hello") is None


def test_a_container_with_garbage_inside_is_400():
    with pytest.raises(AudioInputError) as caught:
        decode_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(8))
    assert caught.value.status == 400


def test_a_truncated_file_is_400():
    for container, codec, rate in (("wav", "pcm_s16le", RATE), ("flac", "flac", RATE)):
        data = encode(tone(4.0), RATE, container, codec, out_rate=rate)
        with pytest.raises(AudioInputError, match="truncated|cannot") as caught:
            decode_bytes(data[: len(data) // 3])
        assert caught.value.status == 400, container


def test_too_long_is_413_naming_the_setting():
    with pytest.raises(AudioInputError, match="max_audio_s") as caught:
        decode_bytes(encode(tone(3.0), RATE, "flac", "flac"), AudioLimits(max_seconds=2.0))
    assert caught.value.status == 413


def test_a_decoder_bomb_stops_while_decoding(monkeypatch):
    """A streamed WAV (its header leaves the length open, so nothing is declared) of 8-bit silence at the lowest
    rate: decoding stops once past max_audio_s, having resampled no more than that much."""
    seconds, rate = 40, 8000
    header = (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate, 1, 8)
              + b"data" + struct.pack("<I", 0xFFFFFFFF))
    data = header + bytes([128]) * (seconds * rate)
    import av

    decoded_frames = []
    original = av.AudioResampler.resample

    def counting(self, frame):
        decoded_frames.append(frame)
        return original(self, frame)

    monkeypatch.setattr(av.AudioResampler, "resample", counting)
    with pytest.raises(AudioInputError, match="decoding stopped") as caught:
        decode_bytes(data, AudioLimits(max_seconds=2.0))
    assert caught.value.status == 413
    decoded = sum(f.samples for f in decoded_frames if f is not None)
    assert decoded < 4 * rate  # stopped near 2.5 s of the 40 s


def test_channel_and_rate_limits_are_400():
    with pytest.raises(AudioInputError, match="max_audio_channels") as caught:
        decode_bytes(encode(tone(0.5, RATE, channels=2), RATE, "wav", "pcm_s16le"), AudioLimits(max_channels=1))
    assert caught.value.status == 400
    with pytest.raises(AudioInputError, match="min_audio_sample_rate") as caught:
        decode_bytes(encode(tone(0.5, 4000), 4000, "wav", "pcm_s16le"))
    assert caught.value.status == 400


def test_wav_for_playback_round_trips():
    samples = (tone(0.5)[0] / 32767).astype(np.float32)
    again = decode_bytes(to_wav(samples))
    assert again.sample_rate == RATE and abs(again.samples.size - samples.size) <= 1
    np.testing.assert_allclose(again.samples[: samples.size], samples, atol=2e-4)


# ---- issue 37 §5: messages that misstated -----------------------------------------------------------------------
def _mp3(seconds: float, rate: int, bit_rate: int, hz: float = 440.0, tagged: bool = True) -> bytes:
    """An MP3 at `rate` and `bit_rate`; tagged: as FFmpeg writes one by default (an ID3v2 tag and a Xing header),
    else bare MPEG frames."""
    from scripts.make_audio_fixtures import encode as encode_with, tone as tone_at

    options = {} if tagged else {"id3v2_version": "0", "write_id3v1": "0", "write_xing": "0"}
    return encode_with(tone_at(seconds, rate, hz=hz), rate, "mp3", "libmp3lame", bit_rate=bit_rate, options=options)


@pytest.mark.parametrize("tagged", [False, True], ids=["bare", "tagged"])
def test_joined_mp3s_of_other_rates_are_refused_naming_the_field(tagged):
    """8 kHz at 8 kbit/s then 44.1 kHz at 128 kbit/s (issue 56 §11): FFmpeg's duration estimate (the first frames'
    bit rate over the file) says 58 s, which was a 413; then it was decoded segment by segment, but joined as FFmpeg
    writes MP3s (each file's ID3v2 tag and Xing header) the second part came 0.1 s later than decoded alone (the first
    file's encoder delay and padding stay in a joined stream): word times not true. A 400 naming `file`, the rates
    and where the rate changes (within one MP3 frame of the first part's end)."""
    first, second = _mp3(3.35, 8000, 8000, tagged=tagged), _mp3(3.35, 44100, 128000, hz=1000.0, tagged=tagged)
    with pytest.raises(AudioInputError) as caught:
        decode_bytes(first + second)
    message = str(caught.value)
    assert caught.value.status == 400 and "sample rate changes part-way" in message, message  # the route names `file`
    assert "8,000 Hz, then 44,100 Hz" in message, message
    at = float(message.split(" from ")[1].split(" s")[0])
    assert abs(at - decode_bytes(first).duration_s) < 0.3, (at, message)  # an untrimmed first part: delay, padding
    # the same parts at one rate decode, and each part alone too
    assert 6.6 < decode_bytes(_mp3(3.35, 8000, 8000, tagged=tagged) * 2).duration_s < 7.1
    assert decode_bytes(second).sample_rate == 44100


def test_joined_tagged_mp3s_of_three_segments_are_refused_at_the_first_change():
    data = _mp3(2.0, 8000, 24000) + _mp3(2.7, 44100, 64000, hz=1000.0) + _mp3(2.0, 8000, 24000)
    with pytest.raises(AudioInputError, match="8,000 Hz, then 44,100 Hz") as caught:
        decode_bytes(data)
    assert caught.value.status == 400


def test_an_mp3_over_the_limit_is_still_stopped_while_decoding():
    with pytest.raises(AudioInputError, match="max_audio_s") as caught:
        decode_bytes(_mp3(3.0, 8000, 8000) + _mp3(3.0, 8000, 8000), AudioLimits(max_seconds=4.0))
    assert caught.value.status == 413


@pytest.mark.parametrize("channels", [65535, 9])
def test_a_wav_declaring_too_many_channels_names_its_count(channels):
    """A WAV whose fmt chunk declares 65,535 channels was refused as "declares 0 channels" (FFmpeg's reading)."""
    data = bytearray(encode(tone(0.25, 8000), 8000, "wav", "pcm_s16le"))
    fmt = data.index(b"fmt ") + 8
    struct.pack_into("<H", data, fmt + 2, channels)  # nChannels
    with pytest.raises(AudioInputError) as caught:
        decode_bytes(bytes(data))
    assert caught.value.status == 400 and f"declares {channels:,} channels" in str(caught.value)
    assert "max_audio_channels" in str(caught.value)


def test_a_truncated_ogg_is_400_whether_cut_mid_page_or_between_pages():
    """Issue 53 §12: FFmpeg decodes the pages an Ogg file has and says nothing of the rest (a 4 s clip cut in half
    decoded to 1.99 s and was accepted); the walk of its pages finds the cut (a page short, or no end-of-stream page)."""
    import re

    data = encode(tone(4.0), RATE, "ogg", "libopus", out_rate=48000)
    assert abs(decode_bytes(data).duration_s - 4.0) < 0.1  # the whole file is fine
    pages = [m.start() for m in re.finditer(b"OggS", data)]
    assert len(pages) >= 4
    for cut, words in ((pages[len(pages) // 2], "without its end-of-stream page"),
                       (pages[len(pages) // 2] + 100, "needs"), (len(data) - 1, "needs")):
        with pytest.raises(AudioInputError, match=words) as caught:
            decode_bytes(data[:cut])
        assert caught.value.status == 400 and "truncated" in str(caught.value)


@pytest.mark.parametrize("field", ["data", "RIFF"])
def test_a_wav_declaring_0xfffffff0_bytes_is_400(field):
    """Issue 53 §12: a 1 s WAV whose header declares 0xFFFFFFF0 bytes was decoded as if nothing were wrong."""
    data = bytearray(encode(tone(1.0), RATE, "wav", "pcm_s16le"))
    at = data.find(b"data") + 4 if field == "data" else 4
    data[at:at + 4] = struct.pack("<I", 0xFFFFFFF0)
    with pytest.raises(AudioInputError, match="declares 4,294,967,280 bytes") as caught:
        decode_bytes(bytes(data))
    assert caught.value.status == 400
    # the streamed-WAV marks ("size unknown") still decode
    data[at:at + 4] = struct.pack("<I", 0xFFFFFFFF)
    assert abs(decode_bytes(bytes(data)).duration_s - 1.0) < 0.01
