"""Render the image page's example pictures into static/samples/ (our own work, CC0; see LICENSE.md there).

There is no internet here and no photo with a clear licence on the machine, so the two "photos" are
scenes drawn with Pillow + numpy (shaded shapes, texture and sensor-like noise), and the third is a
Fashion-MNIST test image (MIT licence), upscaled, for the vit-fashion classifier.

    .venv/bin/python scripts/make_samples.py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "static" / "samples"
W, H = 640, 480


def vertical_gradient(top, bottom, width=W, height=H) -> np.ndarray:
    t = np.linspace(0, 1, height)[:, None, None]  # (H, 1, 1)
    return (np.array(top)[None, None] * (1 - t) + np.array(bottom)[None, None] * t).repeat(width, axis=1)  # (H, W, 3)


def finish(image: Image.Image, rng: np.random.Generator, noise: float = 6.0) -> Image.Image:
    """Soften the edges a little and add sensor-like noise, so the scene reads as a photo."""
    image = image.filter(ImageFilter.GaussianBlur(0.8))
    array = np.asarray(image).astype(np.float32)
    array += rng.normal(0, noise, array.shape)
    return Image.fromarray(np.clip(array, 0, 255).astype(np.uint8))


def street(rng: np.random.Generator) -> Image.Image:
    sky = vertical_gradient((90, 150, 225), (200, 225, 245))
    image = Image.fromarray(sky.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    draw.ellipse((500, 40, 570, 110), fill=(255, 240, 180))  # sun
    for cx, cy, r in ((120, 80, 30), (160, 70, 38), (200, 85, 28)):  # a cloud
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(245, 247, 250))
    draw.polygon([(0, 300), (180, 210), (330, 290), (470, 200), (640, 280), (640, 330), (0, 330)], fill=(110, 140, 110))  # hills
    houses = [(30, 200, 160, (190, 80, 60)), (190, 230, 120, (230, 200, 120)), (330, 190, 150, (120, 140, 180)), (500, 220, 120, (200, 200, 200))]
    for x, top, width, colour in houses:
        draw.rectangle((x, top, x + width, 380), fill=colour, outline=(60, 50, 50))
        draw.polygon([(x - 10, top), (x + width // 2, top - 60), (x + width + 10, top)], fill=(120, 50, 40))  # roof
        for wx in range(x + 15, x + width - 25, 40):
            for wy in range(top + 20, 340, 50):
                draw.rectangle((wx, wy, wx + 22, wy + 28), fill=(250, 240, 190), outline=(80, 70, 60), width=2)
        draw.rectangle((x + width // 2 - 14, 330, x + width // 2 + 14, 380), fill=(90, 60, 40))  # door
    draw.rectangle((0, 380, W, H), fill=(70, 70, 75))  # road
    for x in range(0, W, 80):
        draw.rectangle((x + 10, 425, x + 50, 433), fill=(235, 235, 220))
    # a red car
    draw.rounded_rectangle((220, 385, 420, 445), 14, fill=(200, 30, 35))
    draw.polygon([(260, 385), (290, 350), (370, 350), (395, 385)], fill=(180, 25, 30))
    draw.polygon([(272, 383), (295, 357), (328, 357), (328, 383)], fill=(170, 210, 235))
    draw.polygon([(335, 383), (335, 357), (366, 357), (386, 383)], fill=(170, 210, 235))
    for wx in (260, 380):
        draw.ellipse((wx - 24, 425, wx + 24, 473), fill=(25, 25, 25))
        draw.ellipse((wx - 10, 439, wx + 10, 459), fill=(160, 160, 165))
    # a tree
    draw.rectangle((595, 300, 610, 385), fill=(90, 60, 35))
    for cx, cy, r in ((602, 270, 40), (580, 295, 28), (625, 295, 28)):
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(50, 120, 50))
    return finish(image, rng)


def fruit(rng: np.random.Generator) -> Image.Image:
    wall = vertical_gradient((235, 225, 205), (205, 190, 165))
    image = Image.fromarray(wall.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    table = vertical_gradient((150, 100, 60), (110, 70, 40), W, 190).astype(np.uint8)
    grain = (rng.normal(0, 1, (190, W)).cumsum(axis=1) * 0.6).clip(-25, 25)[:, :, None]  # wood grain
    image.paste(Image.fromarray(np.clip(table + grain, 0, 255).astype(np.uint8)), (0, 290))
    draw.ellipse((150, 370, 500, 420), fill=(80, 55, 35))  # shadow
    fruits = [((250, 300), 55, (220, 40, 40)), ((360, 295), 58, (250, 160, 30)), ((305, 250), 50, (120, 190, 60)),
              ((200, 260), 40, (230, 200, 50)), ((420, 250), 42, (140, 40, 110))]
    for (cx, cy), r, colour in fruits:  # shaded spheres: brighter towards the upper left
        yy, xx = np.mgrid[-r:r, -r:r]
        inside = xx**2 + yy**2 <= r**2
        light = np.clip(1.15 - 0.5 * np.hypot(xx + r * 0.35, yy + r * 0.35) / r, 0.45, 1.2)
        sphere = np.clip(np.array(colour)[None, None] * light[:, :, None], 0, 255).astype(np.uint8)
        mask = Image.fromarray((inside * 255).astype(np.uint8))
        image.paste(Image.fromarray(sphere), (cx - r, cy - r), mask)
    draw.chord((150, 230, 500, 400), 0, 180, fill=(245, 245, 250), outline=(170, 170, 190), width=3)  # the bowl
    draw.rectangle((290, 395, 360, 410), fill=(225, 225, 235))
    draw.line((300, 210, 315, 180), fill=(90, 60, 30), width=5)  # a stem
    return finish(image, rng, noise=5.0)


def fashion_sneaker() -> Image.Image:
    from models.datasets import FASHION_MNIST_CLASSES, load_fashion_mnist

    images, labels = load_fashion_mnist("test")
    index = int(np.nonzero(labels == FASHION_MNIST_CLASSES.index("Sneaker"))[0][0])
    return Image.fromarray(images[index]).resize((224, 224), Image.Resampling.NEAREST)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    street(rng).save(OUT / "street.jpg", quality=88, optimize=True)
    fruit(rng).save(OUT / "fruit.jpg", quality=88, optimize=True)
    try:
        fashion_sneaker().save(OUT / "fashion-sneaker.png", optimize=True)
    except FileNotFoundError as exc:
        print(f"skipping the Fashion-MNIST sample: {exc}")
    for path in sorted(OUT.glob("*.*")):
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
