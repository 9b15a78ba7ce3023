"""Synthetic ImageNet-format JPEG tree: learnable shape x colour classes plus the file quirks of the real set."""
from __future__ import annotations

import argparse
import colorsys
import io
import json
import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from .distributions import Tree, write_formats
from .domains import OneLineParser, OutputPath, at_least, json_holding
from .fsutil import os_error_message

VERSION = 1
JPEG_QUALITY = 90
SHAPES = ("disc", "square", "triangle", "cross", "ring", "star", "diamond", "bars")
HUES = (0.0, 0.16, 0.33, 0.5, 0.66, 0.83)  # red, yellow, green, cyan, blue, magenta
TEXTURES = ("solid", "stripes", "checks")
CONVERT_KINDS = ("cmyk", "grayscale", "png_as_jpeg", "rgba_png", "palette")
SKIP_KINDS = ("truncated", "empty", "garbage")
KAGGLE_FILE, CAFFE_FILE = "LOC_val_solution.csv", "val.txt"
SYNTHETIC_OWN = ("train", "val", KAGGLE_FILE, CAFFE_FILE, "manifest.json")  # what --out holds
# How a tree this module wrote is known: its manifest (generate's keys). A folder holding train/, val/ and a
# manifest.json of something else is not one: its train/ and val/ are not removed for a rerun.
MANIFEST = json_holding("a synthetic tree's manifest.json (data/synthetic.py)",
                        ("classes", "num_classes", "counts", "seed", "version"))
OUTPUT = OutputPath("folder", own=SYNTHETIC_OWN, known={"manifest.json": MANIFEST})


class Job(NamedTuple):
    """One file to write: where, which class, the key of its generator and how to encode it."""

    split: str
    rel: str
    cls: int
    key: tuple[int, ...]
    kind: str  # "jpeg" for a regular image, else a quirk kind


def wnid(c: int) -> str:
    """Fake WordNet id of class c; lexicographic order equals class order."""
    return f"n{1440764 + 1000 * c:08d}"


def class_style(c: int) -> tuple[str, float, str]:
    """(shape, hue, texture) of class c; the first len(SHAPES)*len(HUES) classes are distinct combos."""
    n_combo = len(SHAPES) * len(HUES)
    q, r = divmod(c % n_combo, len(SHAPES))
    # hue shifts with q so neighbouring classes differ in both shape and colour; still a bijection
    return SHAPES[r], HUES[(q + r) % len(HUES)], TEXTURES[(c // n_combo) % len(TEXTURES)]


def _ngon(n: int, r: float = 1.0, phase: float = 0.0) -> np.ndarray:
    t = phase + 2 * np.pi * np.arange(n) / n
    return np.stack([r * np.cos(t), r * np.sin(t)], 1)


def _rect(x0: float, y0: float, x1: float, y1: float) -> np.ndarray:
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], dtype=float)


def _shape_parts(shape: str) -> list[tuple[np.ndarray, int]]:
    """Polygons in [-1, 1]^2 with mask value (255 = object, 0 = hole), drawn in order."""
    if shape == "disc":
        return [(_ngon(48), 255)]
    if shape == "square":
        return [(_rect(-0.8, -0.8, 0.8, 0.8), 255)]
    if shape == "triangle":
        return [(_ngon(3, 1.0, -np.pi / 2), 255)]
    if shape == "cross":
        return [(_rect(-1, -0.3, 1, 0.3), 255), (_rect(-0.3, -1, 0.3, 1), 255)]
    if shape == "ring":
        return [(_ngon(48), 255), (_ngon(48, 0.55), 0)]
    if shape == "star":
        pts = _ngon(10, 1.0, -np.pi / 2)
        pts[1::2] *= 0.42
        return [(pts, 255)]
    if shape == "diamond":
        return [(np.array([[0, -1], [0.65, 0], [0, 1], [-0.65, 0]], dtype=float), 255)]
    if shape == "bars":
        return [(_rect(-1, y, 1, y + 0.4), 255) for y in (-1.0, -0.2, 0.6)]
    raise ValueError(f"unknown shape {shape!r}")


def _image_size(rng: np.random.Generator, min_side: int, max_side: int) -> tuple[int, int]:
    short = int(rng.integers(min_side, max_side + 1))
    aspect = float(np.exp(rng.uniform(np.log(0.6), np.log(1.7))))  # width / height
    return (round(short * aspect), short) if aspect >= 1 else (short, round(short / aspect))


def _background(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """Light or dark low-saturation gradient with grain and a few neutral dots: no class cue."""
    base = rng.uniform(170, 240) if rng.random() < 0.5 else rng.uniform(15, 85)
    c0 = (base + rng.normal(0, 10, 3)).astype(np.float32)
    c1 = c0 + np.float32(rng.uniform(-45, 45)) + rng.normal(0, 8, 3).astype(np.float32)
    theta = rng.uniform(0, 2 * np.pi)
    gx = np.linspace(0, np.cos(theta), w, dtype=np.float32)
    gy = np.linspace(0, np.sin(theta), h, dtype=np.float32)
    t = gy[:, None] + gx[None, :]
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    grain = rng.standard_normal((h, w), dtype=np.float32) * np.float32(rng.uniform(1, 8))
    # channel by channel: broadcasting over a trailing axis of 3 is several times slower
    bands = [Image.fromarray(np.clip(a + t * (b - a) + grain, 0, 255).astype(np.uint8), "L") for a, b in zip(c0, c1)]
    img = Image.merge("RGB", bands)
    draw, short = ImageDraw.Draw(img), min(w, h)
    for _ in range(int(rng.integers(0, 5))):
        r = rng.uniform(0.015, 0.05) * short
        x, y, g = rng.uniform(0, w), rng.uniform(0, h), int(rng.integers(60, 200))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=(g, g, g))
    return img


def _object_mask(rng: np.random.Generator, shape: str, w: int, h: int) -> Image.Image:
    """Mask of the object: longer bbox side 35-75% of the short image side, aspect jitter, small rotation."""
    size = rng.uniform(0.35, 0.75) * (min(w, h) - 1)
    a = np.deg2rad(rng.uniform(-15, 15))
    rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
    stretch = np.exp(rng.uniform(-0.15, 0.15, 2))
    parts = [(pts * stretch @ rot.T, v) for pts, v in _shape_parts(shape)]
    allpts = np.concatenate([p for p, _ in parts])
    lo, hi = allpts.min(0), allpts.max(0)
    # scale by the drawn extent, not the unit box, so thin shapes (star, diamond) are as big as discs
    scale = size / float((hi - lo).max())
    off = np.array([rng.uniform(0, w - 1 - (hi[0] - lo[0]) * scale), rng.uniform(0, h - 1 - (hi[1] - lo[1]) * scale)])
    mask = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(mask)
    for pts, v in parts:
        draw.polygon([tuple(p) for p in (pts - lo) * scale + off], fill=v)
    return mask


def _paint(img: Image.Image, mask: Image.Image, rng: np.random.Generator, hue: float, texture: str) -> None:
    """Fill the mask with the saturated class colour, striped/checked with a darker shade if textured."""
    hue = (hue + rng.uniform(-0.02, 0.02)) % 1.0
    rgb = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.75, 1.0), rng.uniform(0.8, 1.0))) * 255
    img.paste(tuple(int(v) for v in rgb), mask=mask)
    if texture == "solid":
        return
    w, h = img.size
    period = rng.uniform(6, 14)
    off = ((np.arange(h) // period) % 2 == 1)[:, None] & np.ones((1, w), dtype=bool)
    if texture == "checks":
        off ^= ((np.arange(w) // period) % 2 == 1)[None, :]
    dark = Image.fromarray(np.where(off, np.asarray(mask), 0).astype(np.uint8), "L")
    img.paste(tuple(int(v) for v in rgb * 0.5), mask=dark)


def render(c: int, rng: np.random.Generator, min_side: int, max_side: int) -> tuple[Image.Image, Image.Image]:
    """An RGB image of class c and its object mask."""
    shape, hue, texture = class_style(c)
    w, h = _image_size(rng, min_side, max_side)
    img = _background(rng, w, h)
    mask = _object_mask(rng, shape, w, h)
    _paint(img, mask, rng, hue, texture)
    return img, mask


def _encode(img: Image.Image, mask: Image.Image, kind: str) -> bytes:
    """File bytes of a drawn image in the format a (quirk) kind asks for."""
    buf = io.BytesIO()
    if kind == "cmyk":
        img.convert("CMYK").save(buf, "JPEG", quality=JPEG_QUALITY)
    elif kind == "grayscale":
        img.convert("L").save(buf, "JPEG", quality=JPEG_QUALITY)
    elif kind == "png_as_jpeg":
        img.save(buf, "PNG")
    elif kind == "rgba_png":
        rgba = img.convert("RGBA")
        rgba.putalpha(mask.point(lambda v: 255 if v else 200))
        rgba.save(buf, "PNG")
    elif kind == "palette":
        img.convert("P", palette=Image.Palette.ADAPTIVE, colors=64).save(buf, "GIF")
    else:
        img.save(buf, "JPEG", quality=JPEG_QUALITY)
    data = buf.getvalue()
    return data[: len(data) // 2] if kind == "truncated" else data


def _write(root: Path, job: Job, seed: int, min_side: int, max_side: int) -> tuple[int, int, int, int] | None:
    """Write one file; return the inclusive bounding box of the drawn object (None if nothing drawn)."""
    rng = np.random.default_rng([seed, *job.key])
    path = root / job.split / job.rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if job.kind in ("empty", "garbage"):
        # byte 1 = 0xFF rules out TGA, which PIL tries on any header, so no reader claims the bytes
        data = b"" if job.kind == "empty" else b"\x00\xff" + rng.bytes(int(rng.integers(2000, 8000)))
        path.write_bytes(data)
        return None
    img, mask = render(job.cls, rng, min_side, max_side)
    path.write_bytes(_encode(img, mask, job.kind))
    x0, y0, x1, y1 = mask.getbbox() or (0, 0, 1, 1)
    return x0, y0, x1 - 1, y1 - 1


def _train_jobs(k: int, per_class: int, quirks: bool, rng: np.random.Generator) -> list[Job]:
    """Regular train images, with quirk kinds spread over classes (convertible ones replace images)."""
    kinds: dict[tuple[int, int], str] = {}
    extra = [0] * k
    perm = rng.permutation(k) if k else []
    for j, kind in enumerate(CONVERT_KINDS + SKIP_KINDS if quirks and k else ()):
        c = int(perm[j % k])
        if kind in SKIP_KINDS:
            kinds[(c, per_class + extra[c])] = kind
            extra[c] += 1
            continue
        start = int(rng.integers(per_class)) if per_class else 0
        free = [i for i in range(start, start + per_class) if (c, i % per_class) not in kinds]
        if free:
            kinds[(c, free[0] % per_class)] = kind
    return [Job("train", f"{wnid(c)}/{wnid(c)}_{i:05d}.JPEG", c, (0, c, i), kinds.get((c, i), "jpeg"))
            for c in range(k) for i in range(per_class + extra[c])]


def _val_jobs(k: int, per_class: int, quirks: bool, layout: str, rng: np.random.Generator) -> list[Job]:
    """Val images named ILSVRC2012_val_<k>, classes interleaved in seeded order (as the real set)."""
    n = k * per_class
    labels = list(np.repeat(np.arange(k), per_class))
    quirky = quirks and n > 0
    if quirky:
        labels.append(int(rng.integers(k)))  # the truncated extra file, index n before shuffling
    order = rng.permutation(len(labels))
    gray = int(rng.integers(n)) if quirky else -1
    jobs = []
    for pos, src in enumerate(order, start=1):
        c, name = int(labels[src]), f"ILSVRC2012_val_{pos:08d}.JPEG"
        kind = "truncated" if quirky and src == n else "grayscale" if src == gray else "jpeg"
        rel = name if layout == "flat" else f"{wnid(c)}/{name}"
        jobs.append(Job("val", rel, c, (1, pos), kind))
    return jobs


def _quirk_entry(split: str, path: str, kind: str) -> dict[str, str]:
    expect = "convert" if kind in CONVERT_KINDS else "skip" if kind in SKIP_KINDS else "ignore"
    return {"split": split, "path": path, "kind": kind, "expect": expect}


def _write_strays(root: Path, k: int) -> list[dict[str, str]]:
    """Non-image files the real tree does not have but a robust tool must step over."""
    c = k // 2
    (root / "train" / wnid(c)).mkdir(parents=True, exist_ok=True)
    (root / "train" / wnid(c) / "notes.txt").write_text(f"class {wnid(c)}: hand-checked, see README\n")
    (root / "train" / "README.txt").write_text("Synthetic ImageNet-format training images, one folder per wnid.\n")
    return [_quirk_entry("train", f"{wnid(c)}/notes.txt", "stray"), _quirk_entry("train", "README.txt", "stray")]


def _write_label_files(root: Path, jobs: list[Job], boxes: list, rng: np.random.Generator) -> None:
    """Kaggle LOC_val_solution.csv (rows shuffled, as the real one) and Caffe val.txt (sorted)."""
    rows = [f"{Path(j.rel).stem},{wnid(j.cls)} {b[0]} {b[1]} {b[2]} {b[3]}" for j, b in zip(jobs, boxes)]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    (root / KAGGLE_FILE).write_text("ImageId,PredictionString\n" + "".join(r + "\n" for r in rows))
    caffe = sorted(f"{Path(j.rel).name} {j.cls}" for j in jobs)
    (root / CAFFE_FILE).write_text("".join(line + "\n" for line in caffe))


def _prepare(root: Path) -> None:
    """Refuse to write into unrelated data; clear a tree this module wrote before (so reruns are exact)."""
    if not root.exists() or not any(root.iterdir()):
        root.mkdir(parents=True, exist_ok=True)
        return
    if not MANIFEST(root / "manifest.json"):
        raise FileExistsError(f"{root} is not empty and holds no synthetic manifest.json; refusing to write")
    for name in ("train", "val"):
        shutil.rmtree(root / name, ignore_errors=True)
    for name in (KAGGLE_FILE, CAFFE_FILE, "manifest.json"):
        (root / name).unlink(missing_ok=True)


def generate(out: str | os.PathLike, num_classes: int = 10, train_per_class: int = 60, val_per_class: int = 10,
             seed: int = 0, quirks: bool = True, val_layout: str = "flat", min_side: int = 96,
             max_side: int = 320) -> dict:
    """Write the tree under `out` and return the manifest (also written to <out>/manifest.json)."""
    if val_layout not in ("flat", "folders"):
        raise ValueError(f"val_layout must be 'flat' or 'folders', not {val_layout!r}")
    if min(num_classes, train_per_class, val_per_class, seed) < 0 or not 16 <= min_side <= max_side:
        raise ValueError("counts and seed must be >= 0 and 16 <= min_side <= max_side")
    root = Path(out)
    _prepare(root)
    rng = np.random.default_rng(seed)
    train = _train_jobs(num_classes, train_per_class, quirks, rng)
    val = _val_jobs(num_classes, val_per_class, quirks, val_layout, rng)
    boxes = [_write(root, j, seed, min_side, max_side) for j in train + val]
    (root / "train").mkdir(exist_ok=True)
    (root / "val").mkdir(exist_ok=True)
    listed = [_quirk_entry(j.split, j.rel, j.kind) for j in train + val if j.kind != "jpeg"]
    if quirks and num_classes:
        listed += _write_strays(root, num_classes)
    manifest = {"classes": [wnid(c) for c in range(num_classes)], "num_classes": num_classes,
                "counts": {"train": train_per_class * num_classes, "val": val_per_class * num_classes},
                "train_dir": "train", "val_dir": "val", "val_layout": val_layout}
    if val_layout == "flat":
        _write_label_files(root, val, boxes[len(train):], rng)
        manifest["label_files"] = {"kaggle": KAGGLE_FILE, "caffe": CAFFE_FILE}
    manifest.update(quirks=listed, seed=seed, version=VERSION)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def synthetic_tree(root: Path) -> Tree:
    """The Tree of a generated tree (flat val; data.distributions writes its distribution forms): labels
    from its LOC_val_solution.csv, words made up from each class's style."""
    manifest = json.loads((root / "manifest.json").read_text())
    labels = {}
    for line in (root / KAGGLE_FILE).read_text().splitlines()[1:]:
        stem, rest = line.split(",", 1)
        labels[stem] = rest.split()[0]
    val_files = {p.stem: p.name for p in (root / "val").iterdir() if p.is_file()}
    words = {}
    for c, name in enumerate(manifest["classes"]):
        shape, hue, texture = class_style(c)
        words[name] = f"{texture} {shape}, hue {hue:.2f}"
    return Tree(root / "train", root / "val", {val_files[s]: w for s, w in labels.items()}, words)


def main(argv: list[str] | None = None) -> int:
    """CLI: write a synthetic tree and print where everything is."""
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: python scripts/make_synthetic.py --out demo_src --formats")
    p.add_argument("--out", required=True, type=OUTPUT,
                   help="output directory (new, empty, or an earlier synthetic tree)")
    p.add_argument("--classes", type=at_least(1), default=10, help="number of classes (default 10)")
    p.add_argument("--train-per-class", type=at_least(1), default=60, help="training images per class (default 60)")
    p.add_argument("--val-per-class", type=at_least(0), default=10, help="validation images per class (default 10)")
    p.add_argument("--seed", type=at_least(0), default=0, help="the tree is a pure function of the options and "
                   "this seed (default 0)")
    p.add_argument("--no-quirks", action="store_true", help="write only clean RGB JPEGs")
    p.add_argument("--val-layout", choices=("flat", "folders"), default="flat", help="flat: val/<image> with "
                   "label files, as ImageNet's val; folders: val/<wnid>/<image> (default flat)")
    p.add_argument("--min-side", type=at_least(16), default=96, help="the shorter side of an image is drawn "
                   "between --min-side and --max-side pixels (default 96)")
    p.add_argument("--max-side", type=at_least(16), default=320, help="default 320")
    p.add_argument("--formats", action="store_true", help="also write the tree as ImageNet is distributed "
                   "(train tar of per-class tars, val tar, devkit, Hugging Face shards) under <out>/formats")
    a = p.parse_args(argv)
    if a.min_side > a.max_side:
        p.error(f"--min-side {a.min_side} is larger than --max-side {a.max_side}")
    if a.formats and a.val_layout != "flat":
        p.error("--formats needs the flat val layout (the devkit labels flat val images)")
    try:
        m = generate(a.out, a.classes, a.train_per_class, a.val_per_class, a.seed, not a.no_quirks,
                     a.val_layout, a.min_side, a.max_side)
    except (FileExistsError, NotADirectoryError) as e:  # --out holds other files, or is a file
        p.error(os_error_message(e))
    print(f"wrote {m['num_classes']} classes: {m['counts']['train']} train, {m['counts']['val']} val images "
          f"({len(m['quirks'])} quirk files) under {a.out}")
    for name, rel in m.get("label_files", {}).items():
        print(f"  {name} val labels: {os.path.join(a.out, rel)}")
    print(f"  manifest: {os.path.join(a.out, 'manifest.json')}")
    if a.formats:
        written = write_formats(synthetic_tree(Path(a.out)), Path(a.out) / "formats", a.seed)
        for name in ("train_tar", "val_tar", "devkit", "hf_train", "hf_val", "synset_mapping"):
            paths = written[name] if isinstance(written[name], list) else [written[name]]
            print(f"  {name}: {' '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
