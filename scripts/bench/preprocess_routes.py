"""preprocess, routes: the same images through the folder route and the archive routes side by side (the
train tar of per-class tars read in place; Hugging Face gzip shards streamed), generated and real.

One worker per run (the per-worker rate), fresh output each time, routes in turn with the order
alternating between rounds, each route's best round. ``img_per_s`` is the pool's wall time (decode,
resize, write; for shards also the streaming passes, which sit between the decodes); ``setup_s`` is the
rest of the run: listing the folder, or indexing the archive (a full decompression for shards).
CPU times are robust where other work shares the cores and wall times are not: ``worker_cpu_img_per_s``
is images per CPU second of the worker (read, decode, resize, write: the per-worker rate, which
``vs_folder`` compares with the folder route's), ``run_cpu_img_per_s`` per CPU second of the whole run
(this process too: listing or indexing, and the shards' streaming passes).
"""
from __future__ import annotations

import json
import resource
import shutil
import time
from pathlib import Path

from data.distributions import Tree, write_hf_shards, write_train_tar
from data.preprocess import Options, preprocess

REAL_SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "imagenet_sample"


def sample_tree(sample: Path, dst: Path) -> Path:
    """The real ILSVRC2012 sample as a train folder: <wnid>/<wnid>_<k>.JPEG (copies, in a temporary folder)."""
    for k, p in enumerate(sorted(sample.glob("*.JPEG"))):
        wnid = p.name.split("_", 1)[0]
        (dst / wnid).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dst / wnid / f"{wnid}_{k}.JPEG")
    return dst


def _routes(train: Path, tmp: Path) -> dict:
    """The train folder, and the same images as a tar of per-class tars and as two gzip shards."""
    (tmp / "empty_val").mkdir(parents=True, exist_ok=True)
    shards, _ = write_hf_shards(Tree(train, tmp / "empty_val", {}, {}), tmp, shards=2)
    return {"folder": train, "train tar (pread)": write_train_tar(train, tmp / "train.tar"),
            "gzip shards (streamed)": shards}


def route_rows(trees: dict[str, Path], tmp: Path, repeat: int = 3) -> list[dict]:
    """img/s of one worker per route and tree, best of `repeat` rounds, and each route's ratio to the folder's."""
    rows = []
    for label, train in trees.items():
        routes = _routes(train, tmp / label)
        best: dict[str, dict] = {k: {} for k in routes}
        for r in range(repeat):
            for name in (list(routes) if r % 2 == 0 else list(reversed(routes))):
                run = _one_run(routes[name], tmp / "out")
                best[name] = {k: max(v, best[name].get(k, v)) if k != "setup_s" else min(v, best[name].get(k, v))
                              for k, v in run.items()}
        for name, b in best.items():
            rows.append({"what": f"pipeline, {label}, {name}", "workers": 1, "img_per_s": b["img_per_s"],
                         "worker_cpu_img_per_s": round(b["worker_cpu_img_per_s"], 1),
                         "vs_folder": round(b["worker_cpu_img_per_s"] / best["folder"]["worker_cpu_img_per_s"], 3),
                         "run_cpu_img_per_s": round(b["run_cpu_img_per_s"], 1), "setup_s": round(b["setup_s"], 2)})
    return rows


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _one_run(source, out: Path) -> dict[str, float]:
    """One preprocessing run from scratch: pool img/s, setup seconds, images per CPU second of the worker
    (a finished child once the pool shut down) and of the whole run."""
    start = time.perf_counter()
    own, kids = _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN)
    preprocess(source, out, opts=Options(per_file=64), workers=1, quiet=True)
    wall = time.perf_counter() - start
    own, kids = _cpu_seconds(resource.RUSAGE_SELF) - own, _cpu_seconds(resource.RUSAGE_CHILDREN) - kids
    last = json.loads((out / "report.json").read_text())["last_run"]
    shutil.rmtree(out)
    n = last["images"]
    return {"img_per_s": n / last["seconds"], "setup_s": wall - last["seconds"], "worker_cpu_img_per_s": n / kids,
            "run_cpu_img_per_s": n / (own + kids)}


def routes_table(generated: Path, sample: Path, tmp: Path) -> list[dict]:
    """route_rows on the generated train folder and, where present, the real sample."""
    trees = {"generated": generated}
    if sample.is_dir():
        trees["real ILSVRC2012 sample"] = sample_tree(sample, tmp / "real")
    return route_rows(trees, tmp / "routes")
