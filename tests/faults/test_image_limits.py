"""Issue 12, items 10 and 2: Pillow's words never reach users, elongated images are refused, the store is
bounded per image, and an image request's work is bounded by max_image_tokens before it runs.
Before the fix: "exceeds limit of 80000000 pixels, could be decompression bomb" (ours is 40 M); a
40,000,000 × 1 PNG was stored at 120 MB; `image_size` 1036 on dinov2-small ran 73 s at 13 GB."""
from __future__ import annotations

import io
import struct
import zlib

from PIL import Image

from models.images import DecodedImage, ImageStore


def png(width: int, height: int, rows: bytes | None = None) -> bytes:
    """A grayscale PNG; `rows` None → real zero pixels (compressed), else that IDAT payload."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    if rows is None:
        compressor = zlib.compressobj(9)
        row = b"\x00" + b"\x00" * width
        rows = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def upload(client, data: bytes):
    return client.post("/api/images", files={"file": ("x.png", data, "image/png")})


def test_pillow_bomb_message_is_ours(make_client):
    r = upload(make_client(), png(100_000, 100_000, rows=b""))  # the header claims 10 G pixels
    assert r.status_code == 413
    message = r.json()["detail"][0]["msg"]
    assert "40,000,000 (max_image_pixels)" in message and "10,000,000,000 pixels" in message
    assert "bomb" not in message and "80000000" not in message


def test_pillow_decoder_errors_are_ours(make_client):
    data = png(64, 64)
    r = upload(make_client(), data[: len(data) - 30])  # cut inside the pixel data
    assert r.status_code == 400
    message = r.json()["detail"][0]["msg"]
    assert message.startswith("the PNG image is truncated") and "re-upload" in message
    assert "image file is" not in message and "not processed" not in message and "broken data stream" not in message


def test_elongated_image_is_422_naming_the_limit(make_client):
    client = make_client()
    r = upload(client, png(40_000_000, 1))  # 40 M pixels: within max_image_pixels, but no picture
    assert r.status_code == 422
    assert "max_image_aspect_ratio" in r.json()["detail"][0]["msg"]
    assert upload(client, png(400, 40)).status_code == 200  # 10:1 is fine


def test_store_bounds_each_image():
    store = ImageStore(max_short_side=1024, max_long_side=4096)
    image = Image.new("RGB", (12_000, 1_200))
    item = store.put("a" * 32, DecodedImage(image, "PNG", "RGB", 12_000, 1_200))
    assert max(item.image.size) <= 4096 and item.nbytes <= 4096 * 1024 * 3
    assert (item.width, item.height) == (12_000, 1_200)  # the client is still told the upload's size


def test_image_tokens_are_capped_before_any_work(make_client):
    client = make_client(max_image_tokens=40)
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buffer, "PNG")
    image_id = upload(client, buffer.getvalue()).json()["image_id"]
    body = {"model": "vit-fashion", "image_id": image_id, "layers": [0], "heads": [0]}
    assert client.post("/api/image/attention", json=body).status_code == 200  # 28 px: 16 patches + CLS = 17 tokens
    r = client.post("/api/image/attention", json={**body, "image_size": 56})  # 64 + 1 = 65 tokens
    assert r.status_code == 413
    detail = r.json()["detail"]
    assert "max_image_tokens=40" in detail and "65 tokens" in detail and "at most 42 px" in detail
    r = client.post("/api/image/attention", json={**body, "image_size": 1036})  # the probe's size: refused at once
    assert r.status_code == 413 and "21,905 tokens" in r.json()["detail"]
    config = client.get("/image").text
    assert '"max_image_tokens": 40' in config
