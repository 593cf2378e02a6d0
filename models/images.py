"""Decoding untrusted image uploads, a bounded store of decoded images, and preprocessing for ViTs.

No web imports: the routes map `ImageInputError.status` (400/413/415) to HTTP responses.

Decoding (`decode_image`):
- formats allowlisted by magic bytes AND by Pillow's detected format (PNG, JPEG, WebP); the file name
  and the client's content type are never trusted;
- the pixel count is read from the header and checked BEFORE any pixel is decoded; Pillow's own
  decompression-bomb guard (`PIL.Image.MAX_IMAGE_PIXELS`) is set to the same limit as a second line;
- a JPEG too short to hold the pixels its header claims is refused before decoding (`jpeg_min_bytes`):
  libjpeg would otherwise pad a truncated scan with grey and a 631-byte file would become 36 megapixels;
- EXIF orientation applied (`ImageOps.exif_transpose`);
- every mode converted to 8-bit RGB: see `to_rgb`.

Preprocessing (`preprocess`): resize so the SHORTER side equals the model's image size (bicubic), then
center-crop a square — the whole model input is real image content, never padding, and the aspect ratio
is kept (a non-square photo loses its edges along the longer side; `crop_box` says which part is used).
Grayscale models (1 channel, e.g. vit-fashion) get ITU-R 601 luma; nothing is inverted, so a photo
should look like the training data (Fashion-MNIST: light garment on a black background).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from struct import error as StructError  # some Pillow plugins raise it on short headers

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps

from models.lru import BoundedLRU

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")
IMAGE_ID_HEX_CHARS = 32  # 128 bits of sha256: collisions are not a practical concern
DEFAULT_MAX_PIXELS = 40_000_000
DEFAULT_MAX_ASPECT_RATIO = 20.0  # longer side ÷ shorter side; a 40,000,000 × 1 PNG is no photo

log = logging.getLogger(__name__)

ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file is an error, never silently grey pixels


class ImageInputError(ValueError):
    """An upload that cannot be used; `status` is the HTTP status a route should answer with."""

    status = 400


class EmptyImage(ImageInputError):
    status = 400


class CorruptImage(ImageInputError):
    """Right magic bytes, but truncated or undecodable."""

    status = 400


class UnsupportedImageFormat(ImageInputError):
    """Not PNG/JPEG/WebP (another image format, text, or unrecognisable bytes)."""

    status = 415


class ImageTooLarge(ImageInputError):
    """Too many pixels (or too many bytes, when raised by the upload route)."""

    status = 413


class ImageShapeRefused(ImageInputError):
    """Decodable, but too elongated to be a picture the models can use (the aspect-ratio limit)."""

    status = 422


# ---- format sniffing -------------------------------------------------------------------------------
_OTHER_SIGNATURES = {  # recognised so the 415 message can say what the file is
    b"GIF87a": "GIF", b"GIF89a": "GIF", b"BM": "BMP", b"II*\x00": "TIFF", b"MM\x00*": "TIFF",
    b"\x00\x00\x01\x00": "ICO", b"%PDF": "PDF", b"8BPS": "PSD", b"\x00\x00\x00\x0cjP  ": "JPEG 2000",
    b"<svg": "SVG", b"<?xml": "XML/SVG", b"PK\x03\x04": "ZIP",
}


def sniff_format(data: bytes) -> str | None:
    """'PNG' | 'JPEG' | 'WEBP' from the magic bytes, else None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _describe_unknown(data: bytes) -> str:
    for signature, name in _OTHER_SIGNATURES.items():
        if data.startswith(signature):
            return f"a {name} file"
    if len(data) >= 12 and data[4:12] in (b"ftypheic", b"ftypheix", b"ftypmif1", b"ftypavif"):
        return "a HEIF/AVIF file"
    head = data[:512]
    try:
        head.decode("utf-8")
        return "text, not an image"
    except UnicodeDecodeError:
        return "unrecognised bytes"


# ---- decoding --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # 8-bit RGB, EXIF orientation applied
    format: str  # "PNG" | "JPEG" | "WEBP"
    source_mode: str  # Pillow mode before conversion (e.g. "CMYK", "I;16", "P")
    width: int  # after orientation
    height: int


def configure_pillow(max_pixels: int) -> None:
    """Pillow's bomb guard warns above MAX_IMAGE_PIXELS and raises above twice it. decode_image checks
    the header's size itself before decoding (and refuses anything over the limit), so this is the
    second line of defence, matched to the same limit. (No warnings filter: it is process-global state
    and uploads are decoded in several threads.)"""
    Image.MAX_IMAGE_PIXELS = int(max_pixels)


configure_pillow(DEFAULT_MAX_PIXELS)  # the app calls it again with its settings at start-up


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO) -> DecodedImage:
    """Decode an untrusted upload into 8-bit RGB, or raise an ImageInputError subclass. Messages name our
    limits (max_image_pixels, max_image_aspect_ratio), never Pillow's internals."""
    if not data:
        raise EmptyImage("the file is empty")
    sniffed = sniff_format(data)
    if sniffed is None:
        raise UnsupportedImageFormat(f"unsupported file type ({_describe_unknown(data)}); upload a PNG, JPEG or WebP image")
    if Image.MAX_IMAGE_PIXELS is None or Image.MAX_IMAGE_PIXELS < max_pixels:
        configure_pillow(max_pixels)  # never let the global guard refuse what this call's limit allows
    try:
        image = Image.open(io.BytesIO(data), formats=list(ALLOWED_FORMATS))  # reads the header only
        if image.format not in ALLOWED_FORMATS or image.format != sniffed:
            raise UnsupportedImageFormat(f"the file's header says {sniffed} but it decodes as {image.format}")
        width, height = image.size
        if width <= 0 or height <= 0:
            raise CorruptImage(f"the image header gives an empty size {width}×{height}")
        if width * height > max_pixels:  # before a single pixel is decoded
            raise ImageTooLarge(
                f"the image is {width}×{height} = {width * height:,} pixels; the limit is {max_pixels:,} (max_image_pixels)"
            )
        if sniffed == "JPEG" and len(data) < jpeg_min_bytes(width, height):
            raise CorruptImage(
                f"the JPEG image is truncated: its header says {width}×{height} but the file's {len(data):,} bytes cannot "
                f"hold that many pixels (at least {jpeg_min_bytes(width, height):,}); re-export or re-upload the file")
        if max(width, height) > max_aspect_ratio * min(width, height):
            raise ImageShapeRefused(
                f"the image is {width}×{height}: its longer side is {max(width, height) / min(width, height):,.1f} times "
                f"its shorter side; the limit is {max_aspect_ratio:g} (max_image_aspect_ratio)"
            )
        image.load()
        source_mode = image.mode
        image = _exif_transposed(image)
        rgb = to_rgb(image)
    except ImageInputError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's guard (it says "twice" our limit): our words
        found = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = f"{int(found.group(1)):,} pixels" if found else "too many pixels"
        raise ImageTooLarge(f"the image has {pixels}; the limit is {max_pixels:,} (max_image_pixels)") from None
    except Image.UnidentifiedImageError:
        raise CorruptImage(f"the file starts like a {sniffed} image but cannot be decoded") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, StructError) as exc:
        # Pillow's own text ("image file is truncated (3 bytes not processed)", "broken data stream when
        # reading image file", …) names its internals, not what the user can do: keep it for the log.
        log.debug("undecodable %s upload: %s", sniffed, exc)
        what = "truncated (the file ends before the image does)" if "truncated" in str(exc) else "corrupt (its data cannot be decoded)"
        raise CorruptImage(f"the {sniffed} image is {what}; re-export or re-upload the file") from None
    return DecodedImage(image=rgb, format=sniffed, source_mode=source_mode, width=rgb.width, height=rgb.height)


def jpeg_min_bytes(width: int, height: int) -> int:
    """The fewest bytes a Huffman-coded JPEG of this size can have: every 8×8 block of its full-resolution
    component codes at least one DC symbol, and a Huffman code is at least one bit. (Arithmetic-coded JPEGs,
    which almost nothing writes, could be smaller: such a file of a huge flat picture would be refused.)"""
    return -(-width // 8) * -(-height // 8) // 8


def _exif_transposed(image: Image.Image) -> Image.Image:
    """Apply the EXIF orientation; a broken EXIF block is ignored rather than failing the upload."""
    try:
        return ImageOps.exif_transpose(image) or image
    except Exception:  # noqa: BLE001 — malformed EXIF must not turn a decodable photo into an error
        return image


_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I;16S")


def to_rgb(image: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Any Pillow mode → 8-bit RGB.

    - RGB: unchanged. L, 1, YCbCr, LAB, HSV: Pillow's conversion.
    - CMYK: Pillow's conversion (Pillow already un-inverts Adobe CMYK JPEGs when decoding).
    - P: through RGBA when the palette has transparency (then composited), else straight to RGB.
    - RGBA, LA, PA, RGBa, La: alpha-composited on `background` (white), so transparent pixels
      become white, not whatever colour the encoder left under them.
    - I;16*, I (32-bit integer): 16-bit range scaled by 1/257 (65535 → 255), rounded — not clamped
      (Pillow's own I → L conversion clamps, turning almost every 16-bit image white).
    - F (float): [0, 1] scaled by 255 when its maximum is ≤ 1, else taken as [0, 255]; clipped.
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode == "P":
        if "transparency" in image.info:
            return _composite(image.convert("RGBA"), background)
        return image.convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return _composite(image.convert("RGBA"), background)
    if mode in _SIXTEEN_BIT_MODES or mode == "I":
        return _sixteen_bit_to_rgb(image)
    if mode == "F":
        values = np.asarray(image).astype(np.float64)
        finite = values[np.isfinite(values)]
        scale = 255.0 if finite.size and finite.max() <= 1.0 else 1.0
        gray = np.clip(np.rint(np.nan_to_num(values * scale)), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    return image.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


STRIPE_PIXELS = 1 << 20  # 16-bit images are scaled a stripe of about a million pixels at a time


def _sixteen_bit_to_rgb(image: Image.Image) -> Image.Image:
    """16-bit (or 32-bit integer) gray → 8-bit RGB, v ↦ round(v / 257) clipped to 0..255, in integer arithmetic
    and in stripes of rows: the extra memory is a few MB, not the 8 bytes per pixel of a float64 copy of the
    whole image (0.9 GB for a 40-megapixel PNG). (v + 128) // 257 equals round(v / 257) for every integer v:
    v / 257 is never exactly half-way."""
    width, height = image.size
    gray = np.empty((height, width), dtype=np.uint8)  # (H, W)
    rows = max(1, STRIPE_PIXELS // max(1, width))
    for top in range(0, height, rows):
        bottom = min(height, top + rows)
        values = np.asarray(image.crop((0, top, width, bottom))).astype(np.int64)  # (rows, W)
        np.clip((values + 128) // 257, 0, 255, out=values)
        gray[top:bottom] = values
    return Image.fromarray(gray, mode="L").convert("RGB")


def _composite(rgba: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    canvas = Image.new("RGBA", rgba.size, background + (255,))
    return Image.alpha_composite(canvas, rgba).convert("RGB")


def image_id_for(data: bytes) -> str:
    """Content hash of a file: the id of the page's public example photos (the same on every replica).
    Uploads get random ids instead (app/ids.py), so an id never tells whether a known image was uploaded."""
    return hashlib.sha256(data).hexdigest()[:IMAGE_ID_HEX_CHARS]


# ---- the store -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredImage:
    image_id: str
    image: Image.Image  # RGB, possibly downscaled to the store's max side (see ImageStore)
    width: int  # the upload's size after orientation (what the client is told)
    height: int
    format: str
    source_mode: str

    @property
    def nbytes(self) -> int:
        return self.image.width * self.image.height * 3


class ImageStore:
    """Thread-safe LRU of decoded images keyed by content id, bounded by count and bytes.

    Images are kept with their shorter side at most `max_short_side` (no model here uses more than
    518 px) and their longer side at most `max_long_side`, so a 40-megapixel upload costs a few MB, not
    120, whatever its shape: at most max_long_side × max_short_side × 3 bytes (12 MiB) per image.
    """

    def __init__(self, max_items: int = 256, max_bytes: int = 512 * 1024 * 1024, max_short_side: int = 1024,
                 max_long_side: int = 4096):
        self.max_items, self.max_bytes, self.max_short_side = max_items, max_bytes, max_short_side
        self.max_long_side = max_long_side
        self._items: BoundedLRU[str, StoredImage] = BoundedLRU(max_items, max_bytes, size=lambda item: item.nbytes)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, image_id: str) -> bool:
        return image_id in self._items

    def get(self, image_id: str) -> StoredImage | None:
        return self._items.get(image_id)

    def clear(self) -> None:
        self._items.clear()

    def put(self, image_id: str, decoded: DecodedImage) -> StoredImage:
        image = decoded.image
        short, long = min(image.size), max(image.size)
        factor = min(1.0, self.max_short_side / short, self.max_long_side / long)
        if factor < 1.0:
            size = (max(1, round(image.width * factor)), max(1, round(image.height * factor)))
            image = image.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
        item = StoredImage(image_id, image, decoded.width, decoded.height, decoded.format, decoded.source_mode)
        return self._items.put(image_id, item)


# ---- preprocessing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreprocessSpec:
    image_size: int  # square model input, in pixels
    mean: tuple[float, ...]  # per channel, on [0, 1] pixels
    std: tuple[float, ...]
    channels: int = 3  # 1 → grayscale (luma)

    @classmethod
    def from_model_folder(cls, folder: str | Path, image_size: int, channels: int) -> "PreprocessSpec":
        """Read mean/std from the folder's preprocessor_config.json (ImageNet-style 0.5 when absent,
        which is what ViTImageProcessor defaults to)."""
        path = Path(folder) / "preprocessor_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        mean = tuple(float(v) for v in config.get("image_mean", [0.5] * channels))
        std = tuple(float(v) for v in config.get("image_std", [0.5] * channels))
        if len(mean) != channels or len(std) != channels:
            if len(mean) == 1 and len(std) == 1:
                mean, std = mean * channels, std * channels
            else:
                raise ValueError(f"{path}: image_mean/std have {len(mean)}/{len(std)} values for {channels} channels")
        return cls(image_size=image_size, mean=mean, std=std, channels=channels)


def crop_box(width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the centered square that `preprocess` keeps, in the image's pixels."""
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


def model_view(image: Image.Image, image_size: int) -> Image.Image:
    """The RGB square the model sees (before normalisation): center crop of the shorter side, resized."""
    square = image.crop(crop_box(image.width, image.height))
    if square.size != (image_size, image_size):
        square = square.resize((image_size, image_size), Image.Resampling.BICUBIC, reducing_gap=3.0)
    return square


def preprocess(image: Image.Image, spec: PreprocessSpec) -> torch.Tensor:
    """RGB PIL image → normalised pixel_values (1, C, S, S), float32."""
    view = model_view(to_rgb(image), spec.image_size)
    if spec.channels == 1:
        view = view.convert("L")
    array = np.asarray(view, dtype=np.float32) / 255.0  # (S, S) or (S, S, 3)
    if array.ndim == 2:
        array = array[:, :, None]  # (S, S, 1)
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    array = (array - mean) / std  # (S, S, C)
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))).unsqueeze(0)  # (1, C, S, S)
