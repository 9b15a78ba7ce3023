"""One self-contained page per run (report.html): its config, curves, checkpoints, figures, per-class results.

Everything is in the file: the pictures are PNGs in data: URIs, the style is inline, and there is no
script, so the page opens offline. report.json beside it holds the tables' rows (and the evaluation
record they come from, as ``scripts/evaluate.py --json`` writes it for the same weights).
"""
from __future__ import annotations

import base64
import html
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from data.batchfile import atomic_write_bytes, atomic_write_json
from data.domains import Earlier, OutputPath, json_holding

from ..evaluation import Prepared, evaluate
from ..metrics import read_metrics
from . import curves
from .common import read_entries
from .make import CURVES, FIGURES_FOLDER, FigureOptions, make_figures

TOP_CLASSES = 10  # rows of the best and worst classes tables
TOP_CONFUSIONS = 10
_EPOCH_FILE = re.compile(r"^epoch_(\d+)\.pt$")
_STYLE = """body{font-family:sans-serif;max-width:1150px;margin:1em auto;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;margin-top:1.6em}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0}th,td{border:1px solid #ccc;padding:2px 8px}
th{background:#eee}td.n{text-align:right}img{max-width:100%;border:1px solid #ddd}
pre{background:#f6f6f6;padding:.6em;font-size:.8em;overflow:auto}.cols{display:flex;gap:2em;flex-wrap:wrap}"""


class ReportError(ValueError):
    """A run directory that cannot be reported on; names the file at fault."""


@dataclass
class Run:
    """What a run directory holds."""

    root: Path
    config_text: str
    config: dict
    records: list[dict]
    checkpoints: list[Path]  # epoch_NNN.pt in order, then last.pt and best.pt where present
    best: Path  # best.pt, else last.pt, else the newest epoch file


def read_run(root: str | os.PathLike) -> Run:
    """The run directory's config, metrics and checkpoints; ReportError naming what is missing."""
    root = Path(root)
    if not root.is_dir():
        raise ReportError(f"{root}: no such run directory")
    metrics = root / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{metrics}: missing (not a run directory of train.py, or not started yet)")
    records = read_metrics(metrics, warn=lambda message: print(f"warning: {message}", file=sys.stderr))
    if not curves.split_records(records, "val"):
        raise ReportError(f"{metrics}: no validation record yet (validation runs at the end of an epoch)")
    folder = root / "checkpoints"
    epochs = [p for p in folder.glob("epoch_*.pt") if _EPOCH_FILE.match(p.name)] if folder.is_dir() else []
    epochs.sort(key=lambda p: int(_EPOCH_FILE.match(p.name).group(1)))
    named = [folder / n for n in ("last.pt", "best.pt") if (folder / n).is_file()]
    if not epochs and not named:
        raise ReportError(f"{folder}: no checkpoint (best.pt, last.pt or epoch_NNN.pt)")
    best = next((p for p in reversed(named) if p.name == "best.pt"), None) or (named or epochs)[-1]
    config_path = root / "config.yaml"
    text = config_path.read_text() if config_path.is_file() else ""
    try:
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ReportError(f"{config_path}: not valid YAML ({e})") from None
    return Run(root, text, config, records, epochs + named, best)


def data_root(run: Run, data: str | os.PathLike | None) -> Path:
    """--data, else the run config's data.root."""
    if data is not None:
        return Path(data)
    root = (run.config.get("data") or {}).get("root")
    if not root:
        raise ReportError(f"{run.root / 'config.yaml'}: missing or without data.root; pass --data DIR")
    return Path(root)


def checkpoint_rows(run: Run) -> list[dict]:
    """A row per checkpoint file: its stored position, its epoch's validation errors, size, and which files
    are the same file (best.pt and last.pt are hard links to an epoch file)."""
    vals = {(r["epoch"], r["iter"]): r for r in curves.split_records(run.records, "val")}
    rows = []
    for path in run.checkpoints:
        try:
            state, size = read_entries(path), path.stat().st_size
        except Exception as e:  # truncated, not a zip file, code in the pickle: the file is unusable ...
            if not path.exists():  # ... unless it is gone since it was listed: a training run pruned it (keep_last)
                continue
            raise ReportError(f"{path}: cannot be loaded ({type(e).__name__}: {e})") from None
        epoch, step = int(state.get("epoch", 0)), int(state.get("global_step", 0))
        val = vals.get((epoch, step), {})
        same = [p.name for p in run.checkpoints if p != path and _same_file(p, path)]
        rows.append({"file": path.name, "epoch": epoch, "global_step": step, "val_top1_err": val.get("top1_err"),
                     "val_top5_err": val.get("top5_err"), "mib": size / 2 ** 20, "same_as": same})
    return rows


def _same_file(a: Path, b: Path) -> bool:
    """Whether two names are one file (a hard link); a name that is gone is none."""
    try:
        return os.path.samefile(a, b)
    except FileNotFoundError:
        return False


def class_rows(evaluation: dict, most: int = TOP_CLASSES) -> tuple[list[dict], list[dict]]:
    """The `most` best and worst classes by top-1 error (then top-5, then index), classes without images left
    out."""
    seen = [c for c in evaluation["per_class"] if c["n"]]
    best = sorted(seen, key=lambda c: (c["top1_err"], c["top5_err"], c["index"]))[:most]
    worst = sorted(seen, key=lambda c: (-c["top1_err"], -c["top5_err"], c["index"]))[:most]
    return best, worst


def write_report(run: Run, prep: Prepared, out: str | os.PathLike, opts: FigureOptions,
                 device: torch.device) -> dict:
    """Evaluate the best checkpoint, draw the figures and curves under <out's folder>/figures, write the
    page and report.json; returns the JSON record."""
    out = Path(out)
    folder = out.parent / "figures"
    evaluation = evaluate(prep.model, prep.data, prep.info["crop"], prep.normalizer, device=device,
                          batch_size=opts.batch_size, progress=opts.progress)
    figures = make_figures(run.best, prep, folder, opts, device)
    name = run.root.resolve().name
    images = {k: folder / f"{k}.png" for k in (*CURVES, *figures)}  # CURVES: the names the folder allows
    curves.draw_curves(run.records, f"{name}: learning curves", images["curves"])
    curves.draw_throughput(run.records, f"{name}: training throughput", images["throughput"])
    best, worst = class_rows(evaluation)
    record = {"run": str(run.root), "data": str(prep.data.root), "best_checkpoint": str(run.best),
              "checkpoints": checkpoint_rows(run), "evaluation": evaluation, "best_classes": best,
              "worst_classes": worst, "confusions": evaluation["confusions"][:TOP_CONFUSIONS],
              "figures": {k: v["png"] for k, v in figures.items()}}
    atomic_write_bytes(out, _page(run, record, images).encode())
    atomic_write_json(out.with_suffix(".json"), record)
    return record


# -- the page ---------------------------------------------------------------------------------------------


def _page(run: Run, record: dict, images: dict[str, Path]) -> str:
    ev = record["evaluation"]
    # Folder names only: a page is shared, and the machine's paths are not the reader's (config.yaml below
    # is the run's own text, as its author wrote it).
    head = (f"<h1>Run {_e(run.root.resolve().name)}</h1><p>generated "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} &middot; best checkpoint {_e(run.best.name)}: validation top-1 "
            f"error {_pct(ev['top1_err'])}, top-5 error {_pct(ev['top5_err'])} on {ev['n']} images "
            f"(center crop) of {_e(Path(record['data']).resolve().name)}</p>")
    parts = [head, "<h2>Learning curves</h2>", _img(images["curves"], "learning curves"),
             "<h2>Throughput</h2>", _img(images["throughput"], "throughput"),
             "<h2>Checkpoints</h2>", _checkpoint_table(record["checkpoints"])]
    for key, heading in (("filters", "conv1 kernels (Fig. 3)"), ("predictions", "Predictions (Fig. 4, left)"),
                         ("neighbours", "Nearest training images by fc7 features (Fig. 4, right)")):
        if key in images:
            parts += [f"<h2>{heading}</h2>", _img(images[key], heading)]
    parts += ["<h2>Per-class results (best checkpoint, center crop)</h2><div class=cols>",
              f"<div><h3>Best {len(record['best_classes'])}</h3>{_class_table('best-classes', record['best_classes'])}"
              "</div>",
              f"<div><h3>Worst {len(record['worst_classes'])}</h3>"
              f"{_class_table('worst-classes', record['worst_classes'])}</div></div>",
              "<h3>Most confused pairs (true class, top-1 prediction)</h3>", _confusion_table(record["confusions"]),
              "<h2>Config (config.yaml)</h2>", f"<pre>{_e(run.config_text) or '(no config.yaml)'}</pre>"]
    return (f"{_HEAD.decode()}{_e(run.root.resolve().name)}: report</title><style>{_STYLE}</style></head>"
            f"<body>{''.join(parts)}</body></html>\n")


_HEAD = b"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>"


def _is_page(path: Path) -> bool:
    """The head render() writes: a title naming the run (escaped, so at most a few KB), then ": report"."""
    with open(path, "rb") as f:
        head = f.read(8192)
    return head.startswith(_HEAD) and b": report</title><style>" in head


# What an existing page and record must be for a new run to replace them (data.domains.OutputPath).
EARLIER_PAGE = Earlier("an earlier report.py page", _is_page)
EARLIER_RECORD = json_holding("an earlier report.py record (JSON with run, evaluation, best_checkpoint)",
                              ("run", "evaluation", "best_checkpoint"))
PAGE = OutputPath("file", earlier=EARLIER_PAGE)


def outputs(page: str | os.PathLike) -> list[tuple[str, str, OutputPath]]:
    """What a report whose page is `page` writes, as write_report names it: (what, where, its domain)."""
    page = Path(page)
    return [("the page", str(page), PAGE),
            ("its record", str(page.with_suffix(".json")), OutputPath("file", earlier=EARLIER_RECORD)),
            ("its figures", str(page.parent / "figures"), FIGURES_FOLDER)]


def _e(text: str) -> str:
    return html.escape(str(text))


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.2f} %"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<p><img alt="{_e(alt)}" src="data:image/png;base64,{data}"></p>'


def _table(table_id: str, header: tuple[str, ...], rows: list[list[str]], numeric: set[int]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td class=n>{_e(v)}</td>" if i in numeric else f"<td>{_e(v)}</td>"
                                    for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f"<table id={table_id}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _checkpoint_table(rows: list[dict]) -> str:
    return _table("checkpoints", ("file", "epoch", "step", "val top-1", "val top-5", "MiB", "same file as"),
                  [[r["file"], str(r["epoch"]), str(r["global_step"]), _pct(r["val_top1_err"]),
                    _pct(r["val_top5_err"]), f"{r['mib']:.1f}", ", ".join(r["same_as"])] for r in rows],
                  {1, 2, 3, 4, 5})


def _class_table(table_id: str, rows: list[dict]) -> str:
    return _table(table_id, ("class", "wnid", "name", "images", "top-1 error", "top-5 error"),
                  [[str(c["index"]), c["wnid"], c["name"], str(c["n"]), _pct(c["top1_err"]), _pct(c["top5_err"])]
                   for c in rows], {0, 3, 4, 5})


def _confusion_table(rows: list[dict]) -> str:
    return _table("confusions", ("true class", "wnid", "name", "predicted", "wnid", "name", "images",
                                 "share of the class"),
                  [[str(c["label"]), c["label_wnid"], c["label_name"], str(c["pred"]), c["pred_wnid"], c["pred_name"],
                    str(c["count"]), _pct(c["share"])] for c in rows], {0, 3, 6, 7})
