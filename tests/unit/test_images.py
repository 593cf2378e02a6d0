"""Upload decoding, mode conversion, limits and preprocessing (models/images.py): no model, no web."""
from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from app.ids import is_valid_id
from models.images import (
    CorruptImage,
    DecodedImage,
    EmptyImage,
    ImageStore,
    ImageTooLarge,
    PreprocessSpec,
    UnsupportedImageFormat,
    crop_box,
    decode_image,
    image_id_for,
    preprocess,
    sniff_format,
    to_rgb,
)


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def rgb_array(decoded: DecodedImage) -> np.ndarray:
    assert decoded.image.mode == "RGB"
    return np.asarray(decoded.image).astype(int)


# ---- formats ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_allowed_formats_decode_to_rgb(fmt):
    image = Image.new("RGB", (40, 30), (200, 30, 60))
    decoded = decode_image(encode(image, fmt, **({"quality": 95} if fmt != "PNG" else {})))
    assert decoded.format == fmt
    assert (decoded.width, decoded.height) == (40, 30)
    pixel = rgb_array(decoded)[15, 20]
    assert np.abs(pixel - [200, 30, 60]).max() <= 8  # lossy formats may shift a little


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF"])
def test_other_image_formats_are_415(fmt):
    data = encode(Image.new("RGB", (8, 8), "red"), fmt)
    with pytest.raises(UnsupportedImageFormat) as info:
        decode_image(data)
    assert info.value.status == 415
    assert fmt in str(info.value)


def test_text_file_named_png_is_415():
    with pytest.raises(UnsupportedImageFormat, match="text"):
        decode_image(b"hello, I am definitely a PNG\n" * 10)


def test_garbage_bytes_are_415():
    rng = np.random.default_rng(0)
    garbage = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    assert sniff_format(garbage) is None
    with pytest.raises(UnsupportedImageFormat):
        decode_image(garbage)


def test_empty_file_is_400():
    with pytest.raises(EmptyImage) as info:
        decode_image(b"")
    assert info.value.status == 400


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_files_are_400(fmt):
    rng = np.random.default_rng(1)
    noisy = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    data = encode(noisy, fmt)
    with pytest.raises(CorruptImage) as info:
        decode_image(data[: len(data) // 2])
    assert info.value.status == 400


def test_magic_bytes_then_garbage_is_400():
    with pytest.raises(CorruptImage):
        decode_image(b"\x89PNG\r\n\x1a\n" + b"\x00" * 100)
    with pytest.raises(CorruptImage):
        decode_image(b"\xff\xd8\xff" + b"nonsense" * 20)


# ---- limits ----------------------------------------------------------------------------------------
def test_pixel_limit_checked_before_decoding():
    data = encode(Image.new("L", (200, 100), 0))
    assert decode_image(data, max_pixels=20_000).width == 200
    with pytest.raises(ImageTooLarge) as info:
        decode_image(data, max_pixels=19_999)
    assert info.value.status == 413
    assert "20,000" in str(info.value)


def test_pixel_limit_on_a_header_only_bomb():
    """A PNG whose header claims 100k × 100k pixels, with no pixel data at all: refused from the header."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
    with pytest.raises(ImageTooLarge):
        decode_image(data, max_pixels=40_000_000)


# ---- modes -----------------------------------------------------------------------------------------
def test_sixteen_bit_grayscale_is_scaled_not_clamped():
    values = np.array([[0, 257, 32768, 65535]], dtype=np.uint16).repeat(4, axis=0)  # (4, 4)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    decoded = decode_image(encode(image))
    assert decoded.source_mode.startswith("I")
    row = rgb_array(decoded)[0, :, 0]
    assert row.tolist() == [0, 1, 128, 255]  # 32768 / 257 = 127.5 → 128; clamping would give 255s


def test_sixteen_bit_big_endian_and_int32_modes():
    values = np.array([[0, 25700, 65535]], dtype=np.uint16)
    big_endian = Image.frombytes("I;16B", (3, 1), values.astype(">u2").tobytes())
    int32 = Image.fromarray(values.astype(np.int32))
    assert int32.mode == "I"
    for image in (big_endian, int32):
        assert np.asarray(to_rgb(image))[0, :, 1].tolist() == [0, 100, 255]


def test_float_mode():
    image = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))
    assert image.mode == "F"
    assert np.asarray(to_rgb(image))[0, :, 0].tolist() == [0, 128, 255]


def test_cmyk_jpeg_converts_to_rgb_colours():
    cmyk = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # pure red in CMYK
    decoded = decode_image(encode(cmyk, "JPEG", quality=95))
    assert decoded.source_mode == "CMYK"
    red, green, blue = rgb_array(decoded)[8, 8]
    assert red > 200 and green < 50 and blue < 50


def test_palette_with_transparency_composites_on_white():
    palette_image = Image.new("P", (4, 4), 0)
    palette_image.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)  # index 0 black, 1 green
    palette_image.putpixel((1, 1), 1)
    palette_image.info["transparency"] = 0  # black is transparent → white
    decoded = decode_image(encode(palette_image, transparency=0))
    pixels = rgb_array(decoded)
    assert pixels[0, 0].tolist() == [255, 255, 255]
    assert pixels[1, 1].tolist() == [10, 200, 30]


def test_palette_without_transparency():
    palette_image = Image.new("P", (2, 2), 1)
    palette_image.putpalette([0, 0, 0, 12, 34, 56] + [0] * 762)
    assert rgb_array(decode_image(encode(palette_image)))[0, 0].tolist() == [12, 34, 56]


def test_la_and_rgba_composite_on_white():
    la = Image.new("LA", (2, 1))
    la.putpixel((0, 0), (0, 0))  # black, fully transparent → white
    la.putpixel((1, 0), (0, 255))  # black, opaque → black
    assert rgb_array(decode_image(encode(la)))[0].tolist() == [[255, 255, 255], [0, 0, 0]]
    rgba = Image.new("RGBA", (1, 1), (255, 0, 0, 128))  # half-transparent red over white → pink
    assert rgb_array(decode_image(encode(rgba)))[0, 0].tolist() == [255, 127, 127]


def test_grayscale_and_bilevel():
    assert rgb_array(decode_image(encode(Image.new("L", (2, 2), 77))))[0, 0].tolist() == [77, 77, 77]
    assert rgb_array(decode_image(encode(Image.new("1", (2, 2), 1))))[0, 0].tolist() == [255, 255, 255]


@pytest.mark.parametrize("orientation, expected_size", [(1, (30, 20)), (6, (20, 30)), (8, (20, 30)), (3, (30, 20))])
def test_exif_orientation_applied(orientation, expected_size):
    image = Image.new("RGB", (30, 20), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 5, 5))  # a red mark in the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = orientation
    decoded = decode_image(encode(image, "JPEG", quality=95, exif=exif.tobytes()))
    assert decoded.image.size == expected_size
    pixels = rgb_array(decoded)
    h, w = pixels.shape[:2]
    # where the red mark lands after the rotation the EXIF tag asks for
    corner = {1: (0, 0), 3: (h - 1, w - 1), 6: (0, w - 1), 8: (h - 1, 0)}[orientation]
    assert pixels[corner][0] > 200 and pixels[corner][2] < 80


# ---- ids and the store -----------------------------------------------------------------------------
def test_image_id_is_a_content_hash():
    a, b = encode(Image.new("L", (2, 2), 1)), encode(Image.new("L", (2, 2), 2))
    assert image_id_for(a) == image_id_for(bytes(a)) != image_id_for(b)
    assert is_valid_id(image_id_for(a))  # the page's photos are served under their content id: routes accept it


def test_store_is_a_bounded_lru():
    store = ImageStore(max_items=2)
    decoded = decode_image(encode(Image.new("RGB", (4, 4))))
    store.put("a", decoded)
    store.put("b", decoded)
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", decoded)
    assert "b" not in store and "a" in store and "c" in store and len(store) == 2


def test_store_bounds_bytes_and_downscales():
    store = ImageStore(max_items=10, max_bytes=2 * 200 * 100 * 3, max_short_side=100)
    big = decode_image(encode(Image.new("RGB", (400, 200))))
    item = store.put("x", big)
    assert item.image.size == (200, 100) and (item.width, item.height) == (400, 200)
    store.put("y", big)  # 2 × 60 kB fits; a third does not
    store.put("z", big)
    assert len(store) == 2 and "x" not in store


def test_store_is_thread_safe():
    store = ImageStore(max_items=50)
    decoded = decode_image(encode(Image.new("RGB", (2, 2))))

    def worker(offset: int) -> None:
        for i in range(200):
            store.put(f"{offset}-{i % 60}", decoded)
            store.get(f"{offset}-{(i * 7) % 60}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 50


# ---- preprocessing ---------------------------------------------------------------------------------
def test_preprocess_center_crops_the_shorter_side_and_normalises():
    image = Image.new("RGB", (300, 100), (255, 0, 0))
    image.paste((0, 0, 255), (100, 0, 200, 100))  # the central square is blue
    spec = PreprocessSpec(image_size=28, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    pixels = preprocess(image, spec)
    assert pixels.shape == (1, 3, 28, 28) and pixels.dtype == torch.float32
    assert torch.equal(pixels[0, 2], torch.ones(28, 28))  # blue → (1 − 0.5)/0.5, exact in float32
    assert torch.equal(pixels[0, 0], -torch.ones(28, 28))
    assert crop_box(300, 100) == (100, 0, 200, 100)


def test_preprocess_grayscale_model():
    image = Image.new("RGB", (56, 56), (255, 255, 255))
    spec = PreprocessSpec(image_size=28, mean=(0.25,), std=(0.5,), channels=1)
    pixels = preprocess(image, spec)
    assert pixels.shape == (1, 1, 28, 28)
    assert torch.equal(pixels, torch.full_like(pixels, 1.5))  # (1 − 0.25) / 0.5, exact in float32
