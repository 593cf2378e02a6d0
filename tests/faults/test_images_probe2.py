"""Issue 19 §5, §9, §10, §12: a 16-bit 40-megapixel PNG decodes without a float64 copy, a truncated JPEG that
claims 36 megapixels is refused before decoding, upload ids are random capabilities (deduplication stays
internal), and /view renders take turns at the decode gate."""
from __future__ import annotations

import io
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from app.ids import is_valid_id

ROOT = Path(__file__).resolve().parents[2]


def png16(width: int, height: int) -> bytes:
    """A flat 16-bit grayscale PNG (compresses to almost nothing, like the probe's 77 KB file)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    compressor = zlib.compressobj(9)
    row = b"\x00" + b"\x80\x00" * width  # filter 0, every sample 0x8000
    rows = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 16, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def test_sixteen_bit_scaling_is_exact_and_striped():
    from models.images import STRIPE_PIXELS, to_rgb

    values = np.arange(65536, dtype=np.uint16).reshape(64, 1024)  # every 16-bit value, 64 stripes of 1024
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, "PNG")
    image = Image.open(io.BytesIO(buffer.getvalue()))
    image.load()
    assert image.mode == "I;16"
    expected = np.clip(np.rint(values.astype(np.float64) / 257.0), 0, 255).astype(np.uint8)  # the float formula
    import models.images as images

    old = images.STRIPE_PIXELS
    images.STRIPE_PIXELS = 1024 * 3  # three rows a stripe: the last stripe is short
    try:
        rgb = np.asarray(to_rgb(image))
    finally:
        images.STRIPE_PIXELS = old
    assert rgb.shape == (64, 1024, 3) and (rgb[:, :, 0] == expected).all() and (rgb[:, :, 2] == expected).all()
    assert STRIPE_PIXELS <= 1 << 20


def test_a_40_megapixel_16_bit_png_decodes_within_a_few_hundred_mb(tmp_path):
    """The probe: a 77 KB 16-bit 40-megapixel PNG cost about 0.9 GB per decode (a float64 copy of every pixel).
    Peak RSS of a fresh process decoding it: the 16-bit bitmap (80 MB) + 8-bit gray (40 MB) + RGB (120 MB)."""
    path = tmp_path / "big16.png"
    path.write_bytes(png16(8000, 5000))
    script = (
        "import resource, sys\n"
        "from models.images import decode_image\n"
        "data = open(sys.argv[1], 'rb').read()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "decoded = decode_image(data)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(decoded.width, decoded.height, decoded.source_mode, decoded.image.getpixel((10, 10)), (after - before) // 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    width, height, mode, r, g, b, grown_mib = out.stdout.replace("(", "").replace(")", "").replace(",", "").split()
    print(f"\n16-bit 40 MP PNG ({path.stat().st_size:,} bytes): peak RSS +{grown_mib} MiB")
    assert (int(width), int(height), mode) == (8000, 5000, "I;16")
    assert (int(r), int(g), int(b)) == (128, 128, 128)  # 0x8000 = 32768 → round(32768 / 257) = 128
    assert int(grown_mib) < 400, f"decoding took {grown_mib} MiB more (the float64 way: about 900)"


def test_a_truncated_jpeg_claiming_36_megapixels_is_refused(make_client):
    from models.images import CorruptImage, decode_image, jpeg_min_bytes

    buffer = io.BytesIO()
    Image.new("RGB", (6000, 6000), (10, 200, 30)).save(buffer, "JPEG", quality=50)
    whole = buffer.getvalue()
    assert len(whole) > jpeg_min_bytes(6000, 6000)  # even a flat picture is far above the bound
    scan = whole.find(b"\xff\xda")
    truncated = whole[:scan + 200] + b"\xff\xd9"  # the header, a few bytes of scan, end of image: ~800 bytes
    started = time.monotonic()
    try:
        decode_image(truncated)
        raise AssertionError("a truncated JPEG was accepted")
    except CorruptImage as exc:
        assert "truncated" in str(exc) and "6000×6000" in str(exc)
    assert time.monotonic() - started < 0.3  # refused from the header, nothing decoded
    client = make_client()
    r = client.post("/api/images", files={"file": ("x.jpg", truncated, "image/jpeg")})
    assert r.status_code == 400 and "truncated" in r.text
    small = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 30)).save(small, "JPEG")  # a real small JPEG is still accepted
    assert client.post("/api/images", files={"file": ("x.jpg", small.getvalue(), "image/jpeg")}).status_code == 200


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def test_upload_ids_are_random_capabilities_and_content_is_kept_once(make_client):
    import hashlib

    client = make_client()
    data = _png(1)
    first = client.post("/api/images", files={"file": ("a.png", data, "image/png")}).json()["image_id"]
    second = client.post("/api/images", files={"file": ("b.png", data, "image/png")}).json()["image_id"]
    assert is_valid_id(first) and is_valid_id(second) and first != second
    assert hashlib.sha256(data).hexdigest()[:32] not in (first, second)  # the old, guessable id
    # the content hash is no id: nobody can test whether a known image was uploaded
    assert client.get(f"/api/images/{hashlib.sha256(data).hexdigest()[:32]}/view").status_code == 404
    for image_id in (first, second):
        assert client.get(f"/api/images/{image_id}/view", params={"size": 32}).status_code == 200
    store = client.app.state.image_store
    assert len(store.local) == 1  # identical content decoded and kept once


def test_view_renders_take_turns_at_the_decode_gate(make_client):
    """§12: 40 clients fetching /view slowed POSTs 25-fold; views now hold decode slots like decodes."""
    client = make_client(max_concurrent_decodes=1, decode_wait_s=0)
    image_id = client.post("/api/images", files={"file": ("a.png", _png(2), "image/png")}).json()["image_id"]
    gate = client.app.state.decode_gate
    assert gate.limit == 1
    gate._semaphore.acquire_nowait()  # an upload's decode holds the only slot
    try:
        r = client.get(f"/api/images/{image_id}/view", params={"size": 64})
        assert r.status_code == 503 and "max_concurrent_decodes" in r.text and r.headers["retry-after"]
    finally:
        gate.release()
    r = client.get(f"/api/images/{image_id}/view", params={"size": 64})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
