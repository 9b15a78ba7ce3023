"""preprocess: JPEG decode-to-256 images/s per worker with and without Pillow's draft mode (same files,
same process), then the whole preprocessing pipeline with 1 worker and with all workers, on a
generated tree whose image sizes follow ImageNet's (shorter side 333-800 pixels); and what the file
format costs one batch-file task (format 1 against format 2). Then the same images through the folder
and the archive routes (bench/preprocess_routes.py), generated and the real ILSVRC2012 sample.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from alexnet.cli import temporary_directory
from data.decode import load_image
from data.domains import COUNT, InputPath
from data.layouts import is_image_name
from data.preprocess import Options, preprocess
from data.synthetic import generate

from .common import subcommand
from .preprocess_routes import REAL_SAMPLE, routes_table


def add_parser(sub):
    p = subcommand(sub, "preprocess", "JPEG decode and batch-file writing speed", run,
                   (("routes", "the folder route and the archive routes, 1 worker each"),))
    p.add_argument("--images", type=COUNT, default=600, help="training images to generate (default 600)")
    p.add_argument("--routes", action="store_true", help="also the routes table: the same images through the "
                   "folder, train-tar and gzip-shard routes (generated, and the real sample where present)")
    p.add_argument("--sample", type=InputPath("folder"), help="real ILSVRC2012 JPEGs (<wnid>_<words>.JPEG) for "
                   "the routes table; left out where absent")
    p.add_argument("--workers", type=COUNT, default=None, help="pool size of the 'all workers' row")
    return p


def run(args) -> dict:
    workers = args.workers or len(os.sched_getaffinity(0))
    with temporary_directory() as tmp:
        src = Path(tmp) / "src"
        per_class = max(1, args.images // 10)
        generate(src, num_classes=10, train_per_class=per_class, val_per_class=1, seed=0, quirks=False,
                 min_side=333, max_side=800)
        files = sorted(str(p) for p in (src / "train").rglob("*") if p.is_file() and is_image_name(p.name))
        rows = [{"what": "decode+resize, draft mode", "workers": 1, "img_per_s": _decode_rate(files, True)},
                {"what": "decode+resize, full decode", "workers": 1, "img_per_s": _decode_rate(files, False)}]
        for w in sorted({1, workers}):
            out = Path(tmp) / f"out{w}"
            info = preprocess(src / "train", out, opts=Options(), workers=w, quiet=True)
            rows.append({"what": "preprocess pipeline", "workers": w,
                         "img_per_s": info["counts"]["train"]["written"] / _last_seconds(out)})
        rows += _format_rows(src / "train", files[:300], Path(tmp))
        routes = routes_table(src / "train", Path(args.sample or REAL_SAMPLE), Path(tmp)) if args.routes else []
    for r in rows + routes:
        r["img_per_s_per_worker"] = round(r["img_per_s"] / r["workers"], 1)
        r["img_per_s"] = round(r["img_per_s"], 1)
    return {"benchmark": "preprocess", "images": len(files), "cpu_count": len(os.sched_getaffinity(0)),
            "draft_speedup": round(rows[0]["img_per_s"] / rows[1]["img_per_s"], 2), "rows": rows,
            **({"routes": routes} if routes else {})}


def _decode_rate(files: list[str], draft: bool, repeat: int = 2) -> float:
    """Images per second of load_image on one core (best of `repeat` passes, page cache warm)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for f in files:
            load_image(f, 256, "short", draft=draft)
        best = min(best, time.perf_counter() - start)
    return len(files) / best


def _last_seconds(out: Path) -> float:
    return json.loads((out / "report.json").read_text())["last_run"]["seconds"]


def _format_rows(src: Path, files: list[str], tmp: Path, repeat: int = 4) -> list[dict]:
    """One batch file's whole task (decode, resize, checksums, write, fsync) writing format 1 and format
    2 in turn (the order alternating), in this process: what the file format costs preprocessing (best
    of `repeat`; fsync times vary a lot on shared disks)."""
    from functools import partial

    import data.preprocess as pp
    from data.batchfile import write_batch_file
    from data.layouts import Item
    items = tuple(Item(str(Path(f).relative_to(src)), 0) for f in files)
    best = {1: 0.0, 2: 0.0}
    try:
        for r in range(repeat):
            for version in (1, 2) if r % 2 == 0 else (2, 1):
                pp.write_batch_file = partial(write_batch_file, version=version)
                task = pp.Task("train", 0, items, str(src), str(tmp / f"format{version}.h5"), 256, "short")
                start = time.perf_counter()
                best[version] = max(best[version], pp.process_task(task) / (time.perf_counter() - start))
    finally:
        pp.write_batch_file = write_batch_file
    return [{"what": f"one batch-file task writing format {v}", "workers": 1, "img_per_s": rate}
            for v, rate in best.items()]
