"""scripts/report.py's tables without a training run (test_report.py checks them on trained runs): the rows of
hand-made evaluation records and checkpoint folders, and the HTML each table is written as, spelled out by hand.

Fast (no model, no data): `make mutants` mutates alexnet/figures/report.py's table functions against it.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from alexnet.figures import report
from alexnet.figures.report import ReportError, Run

# -- the best and worst classes ------------------------------------------------------------------------------


def _cls(index: int, n: int, top1: float | None, top5: float | None) -> dict:
    return {"index": index, "wnid": f"n{index:08d}", "name": f"class {index}", "n": n, "top1_err": top1,
            "top5_err": top5}


# 13 classes (more than the 10 rows a table shows): ties on top-1 broken by top-5, then by index; two
# classes without images (their errors are None) are left out of both tables.
PER_CLASS = [_cls(0, 4, 0.5, 0.25), _cls(1, 4, 0.25, 0.0), _cls(2, 0, None, None), _cls(3, 4, 0.5, 0.0),
             _cls(4, 2, 1.0, 0.5), _cls(5, 4, 0.25, 0.0), _cls(6, 4, 0.0, 0.0), _cls(7, 4, 0.75, 0.25),
             _cls(8, 4, 0.5, 0.25), _cls(9, 0, None, None), _cls(10, 4, 1.0, 1.0), _cls(11, 4, 0.0, 0.0),
             _cls(12, 4, 0.25, 0.25), _cls(13, 4, 0.75, 0.5), _cls(14, 4, 0.5, 0.5)]


def test_best_and_worst_classes_by_hand():
    best, worst = report.class_rows({"per_class": PER_CLASS})
    # by (top-1, top-5, index): 6, 11 (0, 0); 1, 5 (.25, 0); 12 (.25, .25); 3 (.5, 0); 0, 8 (.5, .25); 14; 7; ...
    assert [c["index"] for c in best] == [6, 11, 1, 5, 12, 3, 0, 8, 14, 7]
    # by (-top-1, -top-5, index): 10 (1, 1); 4 (1, .5); 13 (.75, .5); 7 (.75, .25); 14 (.5, .5); 0, 8; 3; 12; 1
    assert [c["index"] for c in worst] == [10, 4, 13, 7, 14, 0, 8, 3, 12, 1]
    assert best[0] is PER_CLASS[6]  # the rows themselves
    best, worst = report.class_rows({"per_class": PER_CLASS}, most=3)
    assert [c["index"] for c in best] == [6, 11, 1] and [c["index"] for c in worst] == [10, 4, 13]
    few = [_cls(0, 3, 2 / 3, 0.0), _cls(1, 0, None, None), _cls(2, 3, 1 / 3, 1 / 3)]
    best, worst = report.class_rows({"per_class": few})
    assert [c["index"] for c in best] == [2, 0] and [c["index"] for c in worst] == [0, 2]
    assert report.class_rows({"per_class": [_cls(0, 0, None, None)]}) == ([], [])


# -- the checkpoints -----------------------------------------------------------------------------------------


def _save(path: Path, payload_floats: int, **entries) -> None:
    torch.save({**entries, "model": {"w": torch.zeros(payload_floats)}}, path)


@pytest.fixture
def run_dir(tmp_path) -> Run:
    """epoch_1.pt (epoch 1, step 10), epoch_2.pt (epoch 2, step 20), last.pt = epoch_2.pt and best.pt =
    epoch_1.pt as hard links; validation records at (1, 10) and (2, 20), plus train records and a val
    record at another step that must not be taken for either."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    _save(folder / "epoch_001.pt", 1000, epoch=1, global_step=10)
    _save(folder / "epoch_002.pt", 300_000, epoch=2, global_step=20)
    os.link(folder / "epoch_002.pt", folder / "last.pt")
    os.link(folder / "epoch_001.pt", folder / "best.pt")
    records = [{"split": "train", "epoch": 1, "iter": 10, "top1_err": 0.9, "top5_err": 0.8},
               {"split": "val", "epoch": 1, "iter": 10, "top1_err": 0.5, "top5_err": 0.25},
               {"split": "val", "epoch": 2, "iter": 15, "top1_err": 0.1, "top5_err": 0.1},
               {"split": "val", "epoch": 2, "iter": 20, "top1_err": 0.375, "top5_err": 0.125}]
    files = [folder / n for n in ("epoch_001.pt", "epoch_002.pt", "last.pt", "best.pt")]
    return Run(tmp_path, "", {}, records, files, folder / "best.pt")


def test_checkpoint_rows_by_hand(run_dir):
    rows = report.checkpoint_rows(run_dir)
    sizes = [p.stat().st_size / 2 ** 20 for p in run_dir.checkpoints]
    assert sizes[1] > 1 > sizes[0]  # 300,000 floats: 1.1 MiB; 1,000: 0.004 MiB
    assert rows == [
        {"file": "epoch_001.pt", "epoch": 1, "global_step": 10, "val_top1_err": 0.5, "val_top5_err": 0.25,
         "mib": sizes[0], "same_as": ["best.pt"]},
        {"file": "epoch_002.pt", "epoch": 2, "global_step": 20, "val_top1_err": 0.375, "val_top5_err": 0.125,
         "mib": sizes[1], "same_as": ["last.pt"]},
        {"file": "last.pt", "epoch": 2, "global_step": 20, "val_top1_err": 0.375, "val_top5_err": 0.125,
         "mib": sizes[1], "same_as": ["epoch_002.pt"]},
        {"file": "best.pt", "epoch": 1, "global_step": 10, "val_top1_err": 0.5, "val_top5_err": 0.25,
         "mib": sizes[0], "same_as": ["epoch_001.pt"]},
    ]


def test_a_checkpoint_without_position_or_validation(tmp_path):
    """A state without epoch / global_step is at (0, 0); a position no validation record has gets None."""
    _save(tmp_path / "a.pt", 10)
    _save(tmp_path / "b.pt", 10, epoch=3, global_step=7)
    records = [{"split": "val", "epoch": 3, "iter": 8, "top1_err": 0.5, "top5_err": 0.5},
               {"split": "val", "epoch": 0, "iter": 0, "top1_err": 0.75, "top5_err": 0.5}]
    run = Run(tmp_path, "", {}, records, [tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "b.pt")
    a, b = report.checkpoint_rows(run)
    assert (a["epoch"], a["global_step"], a["val_top1_err"], a["val_top5_err"]) == (0, 0, 0.75, 0.5)
    assert (b["epoch"], b["global_step"], b["val_top1_err"], b["val_top5_err"]) == (3, 7, None, None)
    assert a["same_as"] == b["same_as"] == []


def test_an_unloadable_checkpoint_is_named(tmp_path):
    bad = tmp_path / "epoch_001.pt"
    bad.write_bytes(b"PK\x03\x04 not a zip")
    run = Run(tmp_path, "", {}, [], [bad], bad)
    with pytest.raises(ReportError) as e:
        report.checkpoint_rows(run)
    assert str(e.value).startswith(f"{bad}: cannot be loaded (CheckpointError: {bad}")


# -- the HTML of each table ----------------------------------------------------------------------------------


def test_percentages_and_escaping():
    assert report._pct(None) == ""
    assert report._pct(0.123449) == "12.34 %" and report._pct(0.5) == "50.00 %" and report._pct(0) == "0.00 %"
    assert report._pct(1) == "100.00 %"
    assert report._e('<a href="x">&') == "&lt;a href=&quot;x&quot;&gt;&amp;"
    assert report._e(5) == "5"


def test_a_table_spelled_out():
    html = report._table("t<1>", ("a", "b&c"), [["1", "<x>"], ["2", ""]], {0})
    assert html == ("<table id=t<1>><thead><tr><th>a</th><th>b&amp;c</th></tr></thead><tbody>"
                    "<tr><td class=n>1</td><td>&lt;x&gt;</td></tr><tr><td class=n>2</td><td></td></tr>"
                    "</tbody></table>")
    empty = report._table("e", ("h",), [], set())
    assert empty == "<table id=e><thead><tr><th>h</th></tr></thead><tbody></tbody></table>"


def _cells(numeric: list[bool], values: list[str]) -> str:
    cells = (f"<td class=n>{v}</td>" if n else f"<td>{v}</td>" for n, v in zip(numeric, values))
    return "<tr>" + "".join(cells) + "</tr>"


def _head(names: list[str]) -> str:
    return "<thead><tr>" + "".join(f"<th>{h}</th>" for h in names) + "</tr></thead>"


def test_the_checkpoint_table_spelled_out():
    rows = [{"file": "epoch_001.pt", "epoch": 1, "global_step": 10, "val_top1_err": 0.5, "val_top5_err": 0.25,
             "mib": 1.25, "same_as": ["best.pt", "last.pt"]},
            {"file": "x<y>.pt", "epoch": 0, "global_step": 0, "val_top1_err": None, "val_top5_err": None,
             "mib": 0.04, "same_as": []}]
    numeric = [False, True, True, True, True, True, False]
    assert report._checkpoint_table(rows) == (
        "<table id=checkpoints>"
        + _head(["file", "epoch", "step", "val top-1", "val top-5", "MiB", "same file as"]) + "<tbody>"
        + _cells(numeric, ["epoch_001.pt", "1", "10", "50.00 %", "25.00 %", "1.2", "best.pt, last.pt"])
        + _cells(numeric, ["x&lt;y&gt;.pt", "0", "0", "", "", "0.0", ""]) + "</tbody></table>")


def test_the_class_table_spelled_out():
    rows = [_cls(3, 4, 0.5, 0.25), {**_cls(12, 8, 0.125, 0.0), "name": "a & b"}]
    numeric = [True, False, False, True, True, True]
    assert report._class_table("best-classes", rows) == (
        "<table id=best-classes>" + _head(["class", "wnid", "name", "images", "top-1 error", "top-5 error"])
        + "<tbody>" + _cells(numeric, ["3", "n00000003", "class 3", "4", "50.00 %", "25.00 %"])
        + _cells(numeric, ["12", "n00000012", "a &amp; b", "8", "12.50 %", "0.00 %"]) + "</tbody></table>")


def test_the_confusion_table_spelled_out():
    rows = [{"label": 2, "label_wnid": "n2", "label_name": "two", "pred": 0, "pred_wnid": "n0", "pred_name": "zero",
             "count": 3, "share": 0.75}]
    numeric = [True, False, False, True, False, False, True, True]
    assert report._confusion_table(rows) == (
        "<table id=confusions>" + _head(["true class", "wnid", "name", "predicted", "wnid", "name", "images",
                                         "share of the class"])
        + "<tbody>" + _cells(numeric, ["2", "n2", "two", "0", "n0", "zero", "3", "75.00 %"]) + "</tbody></table>")


def test_a_checkpoint_pruned_while_the_report_reads_is_left_out(run_dir):
    """report.py on a run still training: an epoch file run.keep_last removed after the report listed it is
    no row (it failed on it), and no other file is the same as it."""
    (run_dir.root / "checkpoints" / "epoch_001.pt").unlink()  # best.pt, its hard link, stays
    rows = report.checkpoint_rows(run_dir)
    assert [(r["file"], r["same_as"]) for r in rows] == [("epoch_002.pt", ["last.pt"]), ("last.pt", ["epoch_002.pt"]),
                                                         ("best.pt", [])]


# -- where the page goes -------------------------------------------------------------------------------------


def _started_run(root: Path) -> Path:
    """What read_run needs (a validation record, a checkpoint file): the outputs are checked before the
    checkpoint is loaded."""
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "best.pt").write_bytes(b"")
    (root / "metrics.jsonl").write_text('{"split": "val", "epoch": 1, "iter": 6, "top1_err": 0.5}\n')
    return root


@pytest.mark.parametrize("setup, argv, words", [
    ("report.json", [], "argument --out (default): its record: {run}/report.json exists and is not an earlier "
                        "report.py record"),
    ("report.html", [], "argument --out (default): the page: {run}/report.html exists and is not an earlier "
                        "report.py page"),
    ("figures/notes.txt", [], "argument --out (default): its figures: {run}/figures holds files this tool did "
                              "not write ('notes.txt')"),
    ("", ["--out", "{tmp}/page.json"], "argument --out: {tmp}/page.json ends in .json, the name of the page's "
                                       "record beside it"),
    ("meta.json", ["--out", "{tmp}/meta.html"], "argument --out: its record: {tmp}/meta.json exists and is not"),
])
def test_the_page_its_record_and_figures_are_refused_over_someone_elses(tmp_path, capsys, setup, argv, words):
    """The default page and what goes beside a page (its .json record, figures/) are checked as a given --out:
    before, report.py RUN replaced a report.json or figures/ that were not its own, and --out DATA/meta.html
    the data's meta.json. Exit 2, one line, nothing changed."""
    from tests.conftest import load_script
    run = _started_run(tmp_path / "run")
    if setup:
        where = (tmp_path if argv else run) / setup
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text("the user's")
    before = sorted((p.relative_to(tmp_path), p.read_bytes() if p.is_file() else b"") for p in tmp_path.rglob("*"))
    code = load_script("report").main([str(run), "--no-progress", *(a.format(tmp=tmp_path) for a in argv)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("report.py: error: " + words.format(run=run, tmp=tmp_path)), err
    assert sorted((p.relative_to(tmp_path), p.read_bytes() if p.is_file() else b"") for p in tmp_path.rglob("*")) \
        == before


def test_a_folder_that_is_no_run_is_named_before_what_lies_beside_it(tmp_path, capsys):
    """A preprocessed output (it holds its own report.json) given as RUN_DIR: the fault is RUN_DIR."""
    from tests.conftest import load_script
    (tmp_path / "report.json").write_text('{"images": 48}')
    code = load_script("report").main([str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"report.py: error: {tmp_path}/metrics.jsonl: missing (not a run directory of " \
                                 "train.py, or not started yet)"


def test_an_earlier_page_is_known_by_its_head(tmp_path):
    """What render() writes begins so (the run's name in the title, escaped); another page, or the same words
    elsewhere, is not the tool's."""
    def page(text: str):
        path = tmp_path / "p.html"
        path.write_bytes(text.encode())
        return report.EARLIER_PAGE(path)
    head = "<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>"
    assert page(f"{head}run &amp; 1: report</title><style>body {{}}</style></head><body></body></html>\n")
    assert not page(f"{head}run 1: notes</title><style></style></head></html>")
    assert not page("<!DOCTYPE html><html><head><title>run 1: report</title><style></style></head></html>")
    assert not page(f"{head}" + "x" * 9000 + ": report</title><style>")  # past any head render() writes
