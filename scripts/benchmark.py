#!/usr/bin/env python3
"""Benchmarks, each measured side by side in one run and reported as a table (and JSON with --json).

    python scripts/benchmark.py preprocess [--images 600] [--workers N]

preprocess: JPEG decode-to-256 images/s per worker with and without Pillow's draft mode (same files,
same process), then the whole preprocessing pipeline with 1 worker and with all workers, on a
generated tree whose image sizes follow ImageNet's (shorter side 333-800 pixels).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.decode import load_image  # noqa: E402
from data.layouts import is_image_name  # noqa: E402
from data.preprocess import Options, preprocess  # noqa: E402
from data.synthetic import generate  # noqa: E402


def _table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line([r.get(c, "") for c in cols])
                                                                      for r in rows])


def _decode_rate(files: list[str], draft: bool, repeat: int = 2) -> float:
    """Images per second of load_image on one core (best of `repeat` passes, page cache warm)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for f in files:
            load_image(f, 256, "short", draft=draft)
        best = min(best, time.perf_counter() - start)
    return len(files) / best


def bench_preprocess(args) -> dict:
    workers = args.workers or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
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
    for r in rows:
        r["img_per_s_per_worker"] = round(r["img_per_s"] / r["workers"], 1)
        r["img_per_s"] = round(r["img_per_s"], 1)
    return {"benchmark": "preprocess", "images": len(files), "cpu_count": len(os.sched_getaffinity(0)),
            "draft_speedup": round(rows[0]["img_per_s"] / rows[1]["img_per_s"], 2), "rows": rows}


def _last_seconds(out: Path) -> float:
    return json.loads((out / "report.json").read_text())["last_run"]["seconds"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    pp = sub.add_parser("preprocess", help="JPEG decode and batch-file writing speed")
    pp.add_argument("--images", type=int, default=600, help="training images to generate (default 600)")
    pp.add_argument("--workers", type=int, default=None, help="pool size of the 'all workers' row")
    for s in (pp,):
        s.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    result = {"preprocess": bench_preprocess}[args.what](args)
    print(_table(result["rows"], list(result["rows"][0].keys())))
    print({k: v for k, v in result.items() if k != "rows"})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
