"""Faults and bad input for scripts/evaluate.py, scripts/convert_weights.py and scripts/predict.py."""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from .core import READ_ONLY, Case, Ctx, Work, inject, must, train_args, wait_for
from .preprocess_cases import png_declaring


def last(ctx: Ctx) -> Path:
    return ctx.run / "checkpoints" / "last.pt"


def caffenet(ctx: Ctx) -> Path:
    """A one-step caffenet checkpoint at crop 227: the network the Theano layout holds."""
    run = ctx.once("caffenet", lambda p: must(train_args(ctx.data(227), p, model__arch="caffenet", data__crop=227,
                                                         train__max_steps=1)))
    return run / "checkpoints" / "last.pt"


def ev(work: Work, *args, data: Path | None = None, weights: Path | None = None) -> list[str]:
    return ["scripts/evaluate.py", "--data", str(data or work.ctx.data()), "--weights",
            str(weights or last(work.ctx)), "--no-progress", "--batch-size", "8", *map(str, args)]


def cv(*args) -> list[str]:
    return ["scripts/convert_weights.py", *map(str, args)]


def pr(work: Work, *args, weights: Path | None = None) -> list[str]:
    return ["scripts/predict.py", str(weights or last(work.ctx)), *map(str, args), "--data", str(work.ctx.data())]


def image(ctx: Ctx) -> Path:
    return sorted((ctx.src / "train" / "n01440764").glob("*_00000.JPEG"))[0]


def _file(work: Work, name: str, content: bytes) -> Path:
    (work.w / name).write_bytes(content)
    return work.w / name


def _truncated_copy(work: Work, source: Path) -> Path:
    return _file(work, source.name, source.read_bytes()[: source.stat().st_size // 2])


# -- evaluate ----------------------------------------------------------------------------------------

SLOW_EVAL = """import pathlib, time, alexnet.evaluation as ev
_real = ev.predict_log_probs
def slow(*a, **k):
    pathlib.Path({mark!r}).touch()
    time.sleep(60)
    return _real(*a, **k)
ev.predict_log_probs = slow"""


# An earlier output of evaluate.py (anything else at --json is refused before it starts).
EARLIER_JSON = b'{"top1_err": 0.5, "top5_err": 0.25, "n": 4, "crops": 1}\n'


def _ctrl_c_evaluate(work: Work) -> list[str]:
    _file(work, "e.json", EARLIER_JSON)
    return inject(SLOW_EVAL.format(mark=str(work.w / "evaluating")), *ev(work, "--json", work.w / "e.json"))


def _interrupt_while_evaluating(work: Work, proc: subprocess.Popen) -> None:
    wait_for((work.w / "evaluating").exists, proc)
    proc.send_signal(signal.SIGINT)


def _earlier_json_kept(work: Work) -> str | None:
    return None if (work.w / "e.json").read_bytes() == EARLIER_JSON else "the earlier e.json was changed"


def _val_truncated(work: Work) -> list[str]:
    data = work.copy(work.ctx.data(), "data")
    path = data / "val" / "00000.h5"
    path.write_bytes(path.read_bytes()[:1000])
    return ev(work, data=data)


def _under_a_file(work: Work, name: str) -> Path:
    _file(work, "file.txt", b"x")
    return work.w / "file.txt" / name


# -- convert_weights ---------------------------------------------------------------------------------

def _theano_folder_has_no_nan(work: Work) -> str | None:
    import numpy as np
    bad = [p.name for p in sorted((work.w / "theano").glob("*.npy")) if not np.isfinite(np.load(p)).all()]
    return f"wrote NaN weights ({', '.join(bad[:3])})" if bad else None


CASES = [
    Case("evaluate-nan-weights", "silent", "--weights whose every weight is NaN", 2, ("nan.pt", "NaN"),
         lambda w: ev(w, weights=w.ctx.nan_copy(last(w.ctx), "nan")), listed=True),
    Case("evaluate-ctrl-c", "traceback", "Ctrl-C while evaluating, an earlier --json present", 130,
         ("interrupted",), _ctrl_c_evaluate, _earlier_json_kept, during=_interrupt_while_evaluating, listed=True),
    Case("evaluate-json-read-only", "traceback", "--json on a read-only tmpfs", 2, ("{w}/ro/e.json", READ_ONLY),
         lambda w: ev(w, "--json", w.mount("ro", "size=1m,ro") / "e.json"), listed=True),
    Case("evaluate-json-under-a-file", "traceback", "--json FILE/e.json where FILE is a file", 2,
         ("{w}/file.txt/e.json",), lambda w: ev(w, "--json", _under_a_file(w, "e.json"))),
    Case("evaluate-csv-is-a-folder", "traceback", "--csv naming a folder", 2, ("{w}",),
         lambda w: ev(w, "--csv", w.w)),
    Case("evaluate-weights-missing", "traceback", "--weights naming no file", 2, ("{w}/nope.pt",),
         lambda w: ev(w, weights=w.w / "nope.pt")),
    Case("evaluate-weights-garbage", "traceback", "--weights of random bytes", 2, ("{w}/junk.pt",),
         lambda w: ev(w, weights=_file(w, "junk.pt", bytes(range(256)) * 64))),
    Case("evaluate-weights-truncated", "traceback", "--weights cut in half", 2, ("{w}/last.pt",),
         lambda w: ev(w, weights=_truncated_copy(w, last(w.ctx)))),
    Case("evaluate-data-missing", "traceback", "--data naming no folder", 2, ("{w}/nope",),
         lambda w: ev(w, data=w.w / "nope")),
    Case("evaluate-split-missing", "traceback", "--split test (the data has train and val)", 2, ("test",),
         lambda w: ev(w, "--split", "test")),
    Case("evaluate-other-classes", "silent", "--data of 3 classes for weights of 4", 2, ("classes",),
         lambda w: ev(w, data=w.ctx.data(72, classes=3))),
    Case("evaluate-val-truncated", "lost", "val/00000.h5 cut to 1000 bytes", 2, ("{w}/data/val/00000.h5",),
         _val_truncated),
    Case("evaluate-meta-binary", "traceback", "meta.json holding binary bytes", 2, ("{w}/data/meta.json",),
         lambda w: ev(w, data=_damaged_meta(w))),
    Case("convert-src-missing", "traceback", "a source that does not exist", 2, ("{w}/nope.pt",),
         lambda w: cv(w.w / "nope.pt", w.w / "theano")),
    Case("convert-src-garbage", "traceback", "a source .pt of random bytes", 2, ("{w}/junk.pt",),
         lambda w: cv(_file(w, "junk.pt", bytes(range(256)) * 64), w.w / "theano")),
    Case("convert-alexnet-to-theano", "silent", "alexnet weights to the Theano layout (caffenet's only)", 2,
         ("caffenet",), lambda w: cv(last(w.ctx), w.w / "theano")),
    Case("convert-nan-to-theano", "silent", "caffenet weights all NaN to a Theano folder", 2, ("NaN",),
         lambda w: cv(w.ctx.nan_copy(caffenet(w.ctx), "nan-caffenet"), w.w / "theano"), _theano_folder_has_no_nan),
    Case("convert-dst-read-only", "traceback", "the Theano folder on a read-only tmpfs", 2,
         ("{w}/ro/theano", READ_ONLY), lambda w: cv(caffenet(w.ctx), w.mount("ro", "size=1m,ro") / "theano")),
    Case("convert-dst-exists", "silent", "a Theano folder written over by another conversion (cudaconvnet) "
         "without --force", 2, ("--force",),
         lambda w: (must(cv(caffenet(w.ctx), w.w / "theano")),
                    cv(caffenet(w.ctx), w.w / "theano", "--theano-conv", "cudaconvnet"))[1]),
    Case("predict-image-missing", "traceback", "an image that does not exist", 2, ("{w}/nope.jpg",),
         lambda w: pr(w, w.w / "nope.jpg")),
    Case("predict-image-garbage", "traceback", "an image of random bytes", 2, ("{w}/junk.jpg",),
         lambda w: pr(w, _file(w, "junk.jpg", bytes(range(256)) * 4))),
    Case("predict-image-bomb", "traceback", "a PNG declaring 60000x60000 pixels", 2, ("{w}/bomb.png",),
         lambda w: pr(w, _file(w, "bomb.png", png_declaring(60000, 60000)))),
    Case("predict-nan-weights", "silent", "weights whose every weight is NaN", 2, ("nan.pt",),
         lambda w: pr(w, image(w.ctx), weights=w.ctx.nan_copy(last(w.ctx), "nan"))),
    Case("predict-json-under-a-file", "traceback", "--json FILE/p.json where FILE is a file", 2,
         ("{w}/file.txt/p.json",), lambda w: pr(w, image(w.ctx), "--json", _under_a_file(w, "p.json"))),
    Case("predict-top-zero", "silent", "--top 0", 2, ("--top",), lambda w: pr(w, image(w.ctx), "--top", "0")),
]


def _damaged_meta(work: Work) -> Path:
    data = work.copy(work.ctx.data(), "data")
    (data / "meta.json").write_bytes(b"\x89\xff\x00binary")
    return data
