"""scripts/report.py: one self-contained page per run, and the confusion pairs of evaluate.py --json.

The page is checked as a browser would get it: parsed (no script, no link, every picture a data: URI that
decodes), its tables against evaluate.py's own JSON for the same checkpoint, and rendered by headless
Chromium without a network (skipped where no Chromium is installed).
"""
from __future__ import annotations

import base64
import csv
import html
import io
import json
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from PIL import Image

from alexnet.metrics import read_metrics
from tests import children, figure_runs
from tests.conftest import load_script

# Its tests start processes (train.py, tools, groups): not in make test-fast (pytest.ini).
pytestmark = pytest.mark.processes

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


class Page(HTMLParser):
    """The tags, the image sources, the tables (by id: rows of cell texts) and the <pre> text of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str]] = []
        self.images: list[str] = []
        self.tables: dict[str, list[list[str]]] = {}
        self.pre = ""
        self._table = self._cell = None
        self._in_pre = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [(k, v or "") for k, v in attrs]
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        elif tag == "table":
            self._table = self.tables.setdefault(attrs["id"], [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th"):
            self._cell = ""
        self._in_pre = self._in_pre or tag == "pre"

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._table[-1].append(self._cell)
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "pre":
            self._in_pre = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        if self._in_pre:
            self.pre += data


@pytest.fixture(scope="module")
def report():
    return load_script("report").main


@pytest.fixture(scope="module")
def demo(tmp_path_factory, report):
    """The demo-like run with its report (report.html, report.json, figures/)."""
    run = figure_runs.demo_run(tmp_path_factory)
    assert report([str(run), "--no-progress", "--train-images", "1000"]) == 0
    return run


@pytest.fixture(scope="module")
def evaluated(demo, tmp_path_factory):
    """evaluate.py --json and --csv of the run's best checkpoint, as a user would run it."""
    out = tmp_path_factory.mktemp("evaluated")
    data = figure_runs.named_data(tmp_path_factory)
    assert load_script("evaluate").main(["--data", str(data), "--weights", str(demo / "checkpoints" / "best.pt"),
                                         "--json", str(out / "eval.json"), "--csv", str(out / "eval.csv"),
                                         "--no-progress"]) == 0
    with open(out / "eval.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return json.loads((out / "eval.json").read_text()), rows


def pct(cell: str) -> float | None:
    return float(cell.removesuffix(" %")) / 100 if cell else None


def test_the_page_is_self_contained_and_every_image_decodes(demo):
    text = (demo / "report.html").read_text()
    page = Page(text)
    assert not {"script", "link", "iframe", "object", "embed", "base"} & set(page.tags)
    assert all(not v.lower().lstrip().startswith(("http", "//", "file:")) for _, v in page.attrs)
    assert "url(" not in text and "@import" not in text
    assert len(page.images) == 5  # curves, throughput, filters, predictions, neighbours
    embedded = []
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        raw = base64.b64decode(src.split(",", 1)[1], validate=True)
        image = Image.open(io.BytesIO(raw))
        image.load()
        assert image.format == "PNG" and min(image.size) > 50
        embedded.append(raw)
    for name in ("curves", "throughput", "filters", "predictions", "neighbours"):
        assert (demo / "figures" / f"{name}.png").read_bytes() in embedded, name
    assert page.pre == (demo / "config.yaml").read_text()
    # no path of this machine outside the run's own config text: the page is for others to read
    outside = text.replace(html.escape(page.pre), "")
    assert str(demo.resolve().parent) not in outside and str(demo.resolve().parents[1]) not in outside
    assert f"<h1>Run {demo.resolve().name}</h1>" in outside


def test_the_tables_equal_evaluate_json(demo, evaluated):
    record, page = json.loads((demo / "report.json").read_text()), Page((demo / "report.html").read_text())
    ev = evaluated[0]
    assert record["evaluation"]["per_class"] == ev["per_class"]
    assert record["evaluation"]["confusions"] == ev["confusions"]
    seen = [c for c in ev["per_class"] if c["n"]]
    tables = {"best-classes": sorted(seen, key=lambda c: (c["top1_err"], c["top5_err"], c["index"]))[:10],
              "worst-classes": sorted(seen, key=lambda c: (-c["top1_err"], -c["top5_err"], c["index"]))[:10]}
    for table_id, classes in tables.items():
        rows = page.tables[table_id][1:]
        assert [(int(r[0]), r[1], r[2], int(r[3])) for r in rows] == [
            (c["index"], c["wnid"], c["name"], c["n"]) for c in classes]
        for r, c in zip(rows, classes):
            assert abs(pct(r[4]) - c["top1_err"]) < 5e-5 and abs(pct(r[5]) - c["top5_err"]) < 5e-5
    rows = page.tables["confusions"][1:]
    assert rows and [(int(r[0]), r[1], r[2], int(r[3]), r[4], r[5], int(r[6])) for r in rows] == [
        (c["label"], c["label_wnid"], c["label_name"], c["pred"], c["pred_wnid"], c["pred_name"], c["count"])
        for c in ev["confusions"][:10]]
    assert all(abs(pct(r[7]) - c["share"]) < 5e-5 for r, c in zip(rows, ev["confusions"]))


def test_the_checkpoint_table_lists_the_run_files(demo):
    rows = Page((demo / "report.html").read_text()).tables["checkpoints"][1:]
    files = sorted(p.name for p in (demo / "checkpoints").glob("epoch_*.pt")) + ["last.pt", "best.pt"]
    assert [r[0] for r in rows] == files
    vals = {x["epoch"]: x for x in read_metrics(demo / "metrics.jsonl") if x["split"] == "val"}
    for r in rows:
        epoch = torch.load(demo / "checkpoints" / r[0], weights_only=True)["epoch"]
        assert int(r[1]) == epoch and abs(pct(r[3]) - vals[epoch]["top1_err"]) < 5e-5


def test_confusions_count_the_top1_mistakes(evaluated):
    """evaluate.py's confusion pairs == (true, top-1) pairs of distinct classes counted from its CSV."""
    record, rows = evaluated
    pairs = Counter((int(r["label"]), int(r["pred1"])) for r in rows if r["label"] != r["pred1"])
    per_class = Counter(int(r["label"]) for r in rows)
    expected = sorted(pairs.items(), key=lambda item: (-item[1], item[0]))[:20]
    assert expected, "the tiny run makes mistakes"
    assert [((c["label"], c["pred"]), c["count"]) for c in record["confusions"]] == expected
    for c in record["confusions"]:
        assert c["share"] == pytest.approx(c["count"] / per_class[c["label"]])
        assert c["label_name"] == figure_runs.WORDS[c["label_wnid"]]


def chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def offline_prefix() -> list[str]:
    """`unshare -rn` (a network namespace with no interface) where the kernel allows it."""
    try:
        ok = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return ["unshare", "-rn"] if ok else []


@pytest.mark.skipif(chromium() is None, reason="no headless browser installed (Debian: apt-get install chromium)")
def test_the_page_renders_in_chromium_offline(demo, tmp_path):
    shot = tmp_path / "shot.png"
    cmd = [*offline_prefix(), chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
           f"--screenshot={shot}", "--window-size=1200,2000", (demo / "report.html").resolve().as_uri()]
    r = children.run(cmd, cpu_s=180)
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(np.float64)
    assert pixels.shape[:2] == (2000, 1200)
    assert pixels.std() > 20  # not blank
    assert (pixels.min(axis=2) < 200).mean() > 0.05  # a good part of the screen is drawn on


def test_reports_of_a_columns_run_and_of_converted_theano_weights(tmp_path_factory, report):
    columns = figure_runs.columns_run(tmp_path_factory)
    theano_run = figure_runs.theano(tmp_path_factory)[2]
    for run, groups in ((columns, 2), (theano_run, 1)):
        assert report([str(run), "--no-progress", "--train-images", "50"]) == 0
        assert len(Page((run / "report.html").read_text()).images) == 5
        assert json.loads((run / "figures" / "filters.json").read_text())["groups"] == groups


def test_bad_run_directories_exit_2_naming_the_file(tmp_path_factory, demo, report, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report([str(empty)]) == 2
    assert f"{empty / 'metrics.jsonl'}: missing" in capsys.readouterr().err
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    for name in ("metrics.jsonl", "config.yaml"):
        shutil.copy(demo / name, no_ckpt / name)
    assert report([str(no_ckpt)]) == 2
    assert f"{no_ckpt / 'checkpoints'}: no checkpoint" in capsys.readouterr().err
    (no_ckpt / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in (demo / "metrics.jsonl").read_text().splitlines() if '"train"' in line))
    assert report([str(no_ckpt)]) == 2
    assert f"{no_ckpt / 'metrics.jsonl'}: no validation record" in capsys.readouterr().err
    other = figure_runs.theano(tmp_path_factory)[1]  # 6 classes; the run has 4
    assert report([str(demo), "--data", str(other)]) == 2
    assert f"{demo / 'checkpoints' / 'best.pt'}: the model has 4 classes but {other / 'val'} has 6" in \
        capsys.readouterr().err
