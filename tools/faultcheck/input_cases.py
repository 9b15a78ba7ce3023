"""Issue 26's fresh faults, across the tools: a config's YAML (alias bombs, numbers no float or int64 holds,
values quoted without bound), arguments validated before anything is written, standard streams that go
away (`>&-`, `| head`), stop signals (SIGHUP; SIGTERM during an atomic write), misleading messages (disk
space, permissions, state-dict keys, a NaN mean), and weights files that would inflate or unpickle."""
from __future__ import annotations

import signal
import subprocess
import zipfile
from pathlib import Path

from .core import Case, Work, inject, must, restamp_mean, wait_for
from .preprocess_cases import nothing_written, pp
from .tool_cases import SLOW_EVAL, caffenet, cv, ev, image, last, pr
from .train_cases import no_checkpoint, no_temporaries, tr

# `>&-`: a fresh interpreter started with its stdout closed (Python then has no sys.stdout).
STDOUT_CLOSED = "import os\nos.close(1)\nos.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
# `| head -1` once head has exited: stdout is a pipe nobody reads (every write fails with EPIPE).
READER_GONE = "import os\n_r, _w = os.pipe()\nos.close(_r)\nos.dup2(_w, 1)\nos.close(_w)"
# train.lr holding 9^8 'lol's once its aliases are expanded, in 300 bytes: the message that quotes it was
# hundreds of MB (9^9: 802 MB, 2.6 GB of memory).
BOMB = "train: {lr: [&a [lol,lol,lol,lol,lol,lol,lol,lol,lol], " + ", ".join(
    f"&{a} [{','.join([f'*{p}'] * 9)}]" for p, a in zip("abcdefg", "bcdefgh")) + "]}\n"
DIGITS_400 = "1" + "0" * 400
# EACCES as root: opening `path` (Python's open, zipfile's io.open) is refused as for a file of another user.
DENY_OPEN = """import builtins, errno, io, os
_open = io.open
def _deny(file, *args, **kwargs):
    if str(file) == {path!r}:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
    return _open(file, *args, **kwargs)
builtins.open = io.open = _deny"""
# EACCES as root for a batch file: HDF5's own words (it opens files itself, not through Python).
DENY_HDF5 = """import h5py
_File = h5py.File
def _deny(name, *args, **kwargs):
    if str(name) == {path!r}:
        raise OSError(f"Unable to synchronously open file (unable to open file: name = '{{name}}', errno = 13, "
                      "error message = 'Permission denied', flags = 0, o_flags = 0)")
    return _File(name, *args, **kwargs)
h5py.File = _deny"""
IGNORE_SIGHUP = "import signal\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)"  # as nohup starts a command


def _run_dir_with_a_pipe(work: Work) -> list[str]:
    import os
    run = work.w / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train: {epochs: 1}\n")
    os.mkfifo(run / "metrics.jsonl")
    return tr(work)


def _config(text: str, **over):
    def setup(work: Work) -> list[str]:
        (work.w / "config.yaml").write_text(text)
        return tr(work, config=str(work.w / "config.yaml"), **over)
    return setup


def _data(work: Work) -> Path:
    return work.copy(work.ctx.data(), "data")


def _predict_on(work: Work, data: Path, *args) -> list[str]:
    return ["scripts/predict.py", str(last(work.ctx)), str(image(work.ctx)), "--data", str(data), *map(str, args)]


def _damaged_meta(work: Work) -> list[str]:
    data = _data(work)
    (data / "meta.json").write_text("[1, 2, 3]")
    return _predict_on(work, data)


def _nan_mean(work: Work) -> list[str]:
    import numpy as np
    data = _data(work)
    mean = np.load(data / "mean.npy")
    mean[3, 4, 1] = np.nan
    restamp_mean(data, mean)
    return _predict_on(work, data)


def _metrics_not_utf8(work: Work) -> Path:
    run = work.copy(work.ctx.run, "run")
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"split": "val", "\xff\xfe": 1}\n')
    return run


def _file_exists(*parts: str):
    def check(work: Work) -> str | None:
        path = work.w.joinpath(*parts)
        return None if path.exists() else f"{'/'.join(parts)} was not written"
    return check


def _lock_names_its_holder(work: Work) -> str | None:
    missing = _file_exists("run", "checkpoints", "last.pt")(work)
    words = (work.w / "run" / ".lock").read_text().split()
    return missing or (None if len(words) == 2 and words[0].isdigit() else
                       f"run/.lock holds {len(words)} words, not 'pid host' (output written into it?)")


def _nothing_at_out(work: Work) -> str | None:
    return f"{work.w / 'out'} was created before the arguments were checked" if (work.w / "out").exists() else None


def _torchvision_extra_key(work: Work) -> list[str]:
    path = work.w / "tv.pt"
    must(["-c", "import sys, torch; from alexnet.models import build_model; sd = build_model('owt', 4, 0.125, 0.5, "
                "224, init='torch').state_dict(); sd['features.99.weight'] = torch.zeros(3); "
                "torch.save(sd, sys.argv[1])", str(path)])
    return ev(work, weights=path)


def _unreadable_weights(work: Work) -> list[str]:
    path = work.w / "last.pt"
    path.write_bytes(last(work.ctx).read_bytes())
    return inject(DENY_OPEN.format(path=str(path)), *ev(work, weights=path))


def _unreadable_batch_file(work: Work) -> list[str]:
    data = _data(work)
    return inject(DENY_HDF5.format(path=str(data / "train" / "00001.h5")), *tr(work, data=data))


def _zip_bomb(work: Work) -> list[str]:
    """A torch.save file whose one storage is replaced by 64 MiB of zeros, deflated to ~65 KB."""
    small, bomb = work.w / "small.pt", work.w / "bomb.pt"
    must(["-c", "import sys, torch; torch.save({'w': torch.zeros(10)}, sys.argv[1])", str(small)])
    with zipfile.ZipFile(small) as z:
        members = {name: z.read(name) for name in z.namelist()}
    with zipfile.ZipFile(bomb, "w") as z:
        for name, data in members.items():
            z.writestr(name, b"\0" * 2**26 if name.endswith("/data/0") else data, compress_type=zipfile.ZIP_DEFLATED)
    return ev(work, weights=bomb)


def _numpy_object(work: Work) -> list[str]:
    must(["-c", "import sys, numpy, torch; torch.save({'a': numpy.float64(1.0)}, sys.argv[1])", str(work.w / "np.pt")])
    return ev(work, weights=work.w / "np.pt")


def _send_after_a_record(sig: int):
    def during(work: Work, proc: subprocess.Popen) -> None:
        metrics = work.w / "run" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, proc)
        proc.send_signal(sig)
    return during


def _sigterm_while_evaluating(work: Work, proc: subprocess.Popen) -> None:
    wait_for((work.w / "evaluating").exists, proc)
    proc.send_signal(signal.SIGTERM)


def _no_evaluate_outputs(work: Work) -> str | None:
    left = [p.name for p in work.w.iterdir() if p.name != "evaluating"]
    return f"left behind: {', '.join(left)}" if left else None


def _plan_unchanged(work: Work) -> str | None:
    return nothing_written(work) or _nothing_at_out(work)


def _users_folder(work: Work) -> Path:
    folder = work.w / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's")
    return folder


def _users_dataset(work: Work, manifest: bool = True) -> Path:
    """train/ and val/ of the user's images (class folders), with a manifest.json of the user's own (not a
    synthetic one) or without."""
    folder = work.w / "dataset"
    for split in ("train", "val"):
        (folder / split / "n01440764").mkdir(parents=True)
        (folder / split / "n01440764" / "a.JPEG").write_bytes(_USERS)
    if manifest:
        (folder / "manifest.json").write_bytes(b'{"name": "my dataset"}\n')
    return folder


def _users_dataset_unchanged(work: Work) -> str | None:
    left = sorted(p.relative_to(work.w / "dataset").as_posix() for p in (work.w / "dataset").rglob("*"))
    want = [*(["manifest.json"] if "manifest.json" in left else []), "train", "train/n01440764",
            "train/n01440764/a.JPEG", "val", "val/n01440764", "val/n01440764/a.JPEG"]
    gone, new = [n for n in want if n not in left], [n for n in left if n not in want]
    return None if left == want else f"the user's dataset changed: {len(gone)} gone ({', '.join(gone[:3])}), " \
                                     f"{len(new)} new ({', '.join(new[:3])})"


def _users_folder_unchanged(work: Work) -> str | None:
    left = sorted(p.name for p in (work.w / "mine").iterdir())
    return None if left == ["notes.txt"] else f"wrote into the user's folder: {', '.join(left)}"


def _theano_back(work: Work) -> Path:
    return work.w / "theano"


RUN_DONE = _file_exists("run", "checkpoints", "last.pt")
_USERS = b"the user's own file\n"


def _users_file(work: Work, name: str) -> Path:
    path = work.w / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_USERS)
    return path


def _users_file_unchanged(name: str):
    return lambda w: (f"{name} was removed" if not (w.w / name).exists() else
                      None if (w.w / name).read_bytes() == _USERS else f"{name} was replaced")


def _nothing_at(name: str):
    return lambda w: f"{name} was written" if (w.w / name).exists() else None


def _data_copy(work: Work) -> Path:
    return work.copy(work.ctx.data(), "data")


def _data_unchanged(work: Work) -> str | None:
    added = sorted({p.name for p in (work.w / "data").iterdir()} - {p.name for p in work.ctx.data().iterdir()})
    return f"wrote {', '.join(added)} into the data" if added else None


def _run_with_users_image(work: Work) -> Path:
    run = work.copy(work.ctx.run, "run")
    _users_file(work, "run/learning_curve.png")
    return run



def _pipe(work: Work, name: str = "weights.pt") -> Path:
    import os
    path = work.w / name
    os.mkfifo(path)
    return path


CASES = [
    # 1. the config's YAML
    Case("config-alias-bomb", "traceback", "a 300-byte YAML alias bomb (9^8 values once expanded) as config.yaml",
         2, ("{w}/config.yaml", "aliases"), _config(BOMB), no_checkpoint, timeout=60),
    Case("config-long-value-quoted", "traceback", "train.lr_steps of 5000 values, not increasing", 2,
         ("train.lr_steps", "(5000 items)"), lambda w: tr(w, train__lr_steps="[" + ",".join(["1"] * 5000) + "]"),
         no_checkpoint),
    Case("config-lr-1e400", "misleading", "train.lr=1e400 (a float would read it as inf)", 2,
         ("1e400", "beyond the range of a float"), lambda w: tr(w, train__lr="1e400"), no_checkpoint),
    Case("config-epochs-400-digits", "traceback", "train.epochs of 400 digits", 2, ("train.epochs", "64 bits"),
         lambda w: tr(w, train__epochs=DIGITS_400), no_checkpoint),
    Case("config-is-a-folder", "misleading", "the config path names a folder", 2, ("{w}", "is a folder"),
         lambda w: tr(w, config=str(w.w))),
    # 2. arguments validated before anything is written
    Case("preprocess-seed-negative", "lost", "--seed -1 (a plan.json left behind blocked the right command)", 2,
         ("--seed",), lambda w: pp("--train-dir", w.ctx.src / "train", "--out", w.w / "out", "--seed", "-1"),
         _plan_unchanged),
    Case("predict-meta-damaged", "traceback", "--data whose meta.json holds a JSON list", 2, ("{w}/data/meta.json",),
         _damaged_meta),
    Case("plot-metrics-not-utf8", "traceback", "metrics.jsonl with a line that is not UTF-8", 0, ("not UTF-8",),
         lambda w: ["scripts/plot.py", str(_metrics_not_utf8(w)), "--out", str(w.w / "c.png")],
         _file_exists("c.png"), line="is damaged"),
    Case("report-metrics-not-utf8", "traceback", "report.py on a metrics.jsonl with a line that is not UTF-8", 0,
         ("not UTF-8",), lambda w: ["scripts/report.py", str(_metrics_not_utf8(w)), "--no-progress",
                                    "--train-images", "8", "--batch-size", "8"],
         _file_exists("run", "report.html"), line="is damaged", timeout=180),
    # 2 and 4. standard streams that go away
    Case("train-stdout-closed", "lost", "train.py >&- (stdout closed)", 0, (), lambda w: inject(STDOUT_CLOSED, *tr(w)),
         _lock_names_its_holder),
    Case("train-stdout-closed-replicas", "lost", "train.py >&- with parallel.replicas=2", 0, (),
         lambda w: inject(STDOUT_CLOSED, *tr(w, parallel__replicas=2)), _lock_names_its_holder, timeout=180),
    Case("train-stdout-reader-gone", "lost", "train.py | head -1 (stdout's reader gone: EPIPE)", 0,
         ("standard output is gone",), lambda w: inject(READER_GONE, *tr(w, train__epochs=2)),
         _file_exists("run", "checkpoints", "epoch_002.pt"), line="standard output is gone"),
    Case("evaluate-stdout-reader-gone", "traceback", "evaluate.py --json | head -1", 0, (),
         lambda w: inject(READER_GONE, *ev(w, "--json", w.w / "e.json")), _file_exists("e.json")),
    Case("predict-stdout-reader-gone", "traceback", "predict.py --json | head -1", 0, (),
         lambda w: inject(READER_GONE, *pr(w, image(w.ctx), "--json", w.w / "p.json")), _file_exists("p.json")),
    Case("preprocess-stdout-reader-gone", "traceback", "preprocess.py | head -1", 0, (),
         lambda w: inject(READER_GONE, *pp("--train-dir", w.ctx.src / "train", "--out", w.w / "out")),
         _file_exists("out", "meta.json")),
    Case("make-synthetic-stdout-closed", "traceback", "make_synthetic.py >&-", 0, (),
         lambda w: inject(STDOUT_CLOSED, "scripts/make_synthetic.py", "--out", str(w.w / "s"), "--classes", "2",
                          "--train-per-class", "2", "--val-per-class", "1"), _file_exists("s", "val.txt")),
    # 3. misleading messages
    Case("train-width-64", "misleading", "model.width=64 (its checkpoint outgrows the disk)", 2,
         ("model.width=64", "GiB", "free"), lambda w: tr(w, model__width=64), no_checkpoint),
    Case("train-width-200", "traceback", "model.width=200 (beyond any AlexNet)", 2,
         ("model.width must be in (0, 64]", "200"), lambda w: tr(w, model__width=200), no_checkpoint),
    Case("train-lr-1e39", "traceback", "train.lr=1e39 (overflows float32 in the update)", 2,
         ("train.lr must be at most 1e+30",), lambda w: tr(w, train__lr="1e39"), no_checkpoint),
    Case("evaluate-weights-unreadable", "misleading", "--weights that cannot be opened (EACCES injected)", 2,
         ("{w}/last.pt", "permission denied"), _unreadable_weights),
    Case("train-batch-unreadable", "misleading", "a batch file HDF5 cannot open (EACCES injected)", 2,
         ("{w}/data/train/00001.h5", "cannot be read", "Permission denied"), _unreadable_batch_file, no_checkpoint),
    Case("evaluate-torchvision-extra-key", "misleading", "a torchvision state dict with one key too many", 2,
         ("features.99.weight",), _torchvision_extra_key),
    Case("predict-mean-nan", "silent", "--data whose mean.npy holds NaN", 2, ("{w}/data/mean.npy", "NaN"),
         _nan_mean),
    # 4. signals
    Case("train-sighup", "lost", "SIGHUP (terminal closed) once a train record is written", 129, ("SIGHUP",),
         lambda w: tr(w, train__epochs=50), RUN_DONE, during=_send_after_a_record(signal.SIGHUP)),
    Case("train-sighup-replicas", "lost", "SIGHUP to the launcher of parallel.replicas=2", 129, (),
         lambda w: tr(w, train__epochs=50, parallel__replicas=2), RUN_DONE,
         during=_send_after_a_record(signal.SIGHUP), timeout=180),
    Case("train-sighup-ignored", "accepted", "SIGHUP to a run started with it ignored (nohup)", 0, (),
         lambda w: inject(IGNORE_SIGHUP, *tr(w, train__epochs=3)), _file_exists("run", "checkpoints", "epoch_003.pt"),
         during=_send_after_a_record(signal.SIGHUP)),
    Case("evaluate-sigterm", "lost", "SIGTERM while evaluating with --csv and --json", 143, ("SIGTERM",),
         lambda w: inject(SLOW_EVAL.format(mark=str(w.w / "evaluating")), *ev(w, "--csv", w.w / "e.csv", "--json",
                                                                               w.w / "e.json")),
         lambda w: _no_evaluate_outputs(w) or no_temporaries(w), during=_sigterm_while_evaluating),
    # 5. weights files that would inflate or unpickle
    Case("evaluate-weights-zip-bomb", "lost", "--weights: a 65 KB zip whose members inflate to 64 MiB", 2,
         ("{w}/bomb.pt", "inflate"), _zip_bomb),
    Case("evaluate-weights-numpy-object", "misleading", "--weights holding a numpy scalar (refused unpickling)", 2,
         ("{w}/np.pt", "not plain weights", "never unpickled"), _numpy_object),
    # 6. issues 33 and 34: outputs among the user's files, declared option domains, names, dry runs
    Case("preprocess-out-users-folder", "lost", "--out a folder of the user's files (preprocess wrote among them)",
         2, ("--out", "did not write", "notes.txt"),
         lambda w: pp("--train-dir", w.ctx.src / "train", "--out", _users_folder(w)), _users_folder_unchanged),
    Case("make-synthetic-out-users-folder", "traceback", "make_synthetic --out a folder of the user's files", 2,
         ("{w}/mine", "did not write"), lambda w: ["scripts/make_synthetic.py", "--out", str(_users_folder(w))],
         _users_folder_unchanged),
    Case("figures-out-users-folder", "lost", "figures.py --out a folder of the user's files", 2,
         ("--out", "{w}/mine", "did not write", "notes.txt"),
         lambda w: ["scripts/figures.py", "--weights", str(last(w.ctx)), "--data", str(w.ctx.data()), "--out",
                    str(_users_folder(w))], _users_folder_unchanged),
    Case("evaluate-json-empty", "lost", "evaluate.py --json '' (an empty path)", 2, ("--json", "empty"),
         lambda w: ev(w, "--json", "")),
    Case("convert-rerun-finished", "misleading", "the same Theano-folder conversion run again once finished", 0,
         ("unchanged",), lambda w: (must(cv(caffenet(w.ctx), w.w / "theano")), must(cv(_theano_back(w), w.w / "w.pt")),
                                    cv(_theano_back(w), w.w / "w.pt"))[2], line="unchanged"),
    Case("make-synthetic-classes-0", "silent", "make_synthetic --classes 0 (took any integer)", 2,
         ("--classes", ">= 1"), lambda w: ["scripts/make_synthetic.py", "--out", str(w.w / "out"), "--classes", "0"],
         _nothing_at_out),
    Case("evaluate-weights-unknown-name", "misleading", "--weights torchvisoin (a misspelt published name)", 2,
         ("torchvisoin", "published weight set"), lambda w: ev(w, weights=Path("torchvisoin"))),
    Case("train-dry-run-no-data", "lost", "train.py --dry-run with data.root missing", 2,
         ("{w}/none",), lambda w: [*tr(w, data=w.w / "none"), "--dry-run"],
         lambda w: None if not (w.w / "run").exists() else "a dry run wrote run/"),
    # 7. issue 33: a pipe or a device where a file is read or written
    Case("convert-weights-from-a-pipe", "hang", "convert_weights.py reading a named pipe nobody writes", 2,
         ("{w}/weights.pt", "not a regular file"), lambda w: cv(_pipe(w), w.w / "out.pt"), timeout=60),
    Case("train-resume-from-a-pipe", "hang", "run.resume_from naming a named pipe nobody writes", 2,
         ("run.resume_from", "{w}/weights.pt", "not a regular file"),
         lambda w: tr(w, run__resume_from=str(_pipe(w))), no_checkpoint, timeout=60),
    Case("evaluate-json-to-a-pipe", "lost", "--json naming a named pipe (the atomic write would replace it)", 2,
         ("--json", "not a regular file"), lambda w: ev(w, "--json", _pipe(w, "out.json")),
         lambda w: None if (w.w / "out.json").is_fifo() else "the pipe was replaced"),
    Case("train-run-dir-a-device", "misleading", "run.dir=/dev/null (said only 'File exists')", 2,
         ("run.dir=/dev/null", "not a folder"), lambda w: tr(w, run=Path("/dev/null"))),
    Case("train-run-dir-holds-a-pipe", "hang", "a run directory whose metrics.jsonl is a named pipe", 2,
         ("run.dir=", "holds metrics.jsonl", "not a regular file"), _run_dir_with_a_pipe, no_checkpoint,
         timeout=60),
    # One file, two writers: an output file over a file the tool did not make, two outputs on one file.
    Case("evaluate-json-over-users-config", "lost", "evaluate.py --json naming the user's config.yaml (replaced)", 2,
         ("--json", "{w}/config.yaml", "exists and is not"),
         lambda w: ev(w, "--json", _users_file(w, "config.yaml")), _users_file_unchanged("config.yaml")),
    Case("evaluate-json-and-csv-one-file", "lost", "evaluate.py --json and --csv naming one new file (the CSV "
         "replaced by the JSON)", 2, ("--json and --csv both name", "{w}/results"),
         lambda w: ev(w, "--json", w.w / "results", "--csv", w.w / "results"), _nothing_at("results")),
    Case("report-out-beside-data-meta", "lost", "report.py --out DATA/meta.html (its record, meta.html's .json, "
         "would replace the data's meta.json; a page inside a preprocessed output is refused first)", 2,
         ("--out", "meta.html", "inside the preprocessed output"),
         lambda w: ["scripts/report.py", str(w.ctx.run), "--no-progress", "--out", str(_data_copy(w) / "meta.html")],
         lambda w: None if (w.w / "data" / "meta.json").read_bytes() == (w.ctx.data() / "meta.json").read_bytes()
         else "the data's meta.json was replaced"),
    Case("plot-default-over-users-image", "lost", "plot.py RUN where RUN/learning_curve.png is the user's own "
         "image", 2, ("--out (default)", "learning_curve.png", "exists and is not"),
         lambda w: ["scripts/plot.py", str(_run_with_users_image(w))],
         _users_file_unchanged("run/learning_curve.png")),
    Case("train-run-dir-a-preprocessed-output", "lost", "run.dir naming a preprocessed output (its .lock was taken "
         "for a run's: the run wrote config.yaml, metrics.jsonl and checkpoints/ among the data)", 2,
         ("run.dir=", "{w}/data", "not a training run's"), lambda w: tr(w, run=_data_copy(w)), _data_unchanged),
    Case("train-run-dir-inside-the-data", "lost", "run.dir=DATA/runs/demo (a new folder inside the preprocessed "
         "output: the run wrote among the data)", 2, ("run.dir=", "{w}/data/runs/demo", "inside data.root="),
         lambda w: tr(w, data=_data_copy(w), run=w.w / "data" / "runs" / "demo"), _data_unchanged),
    Case("figures-out-inside-the-data", "lost", "figures.py --out DATA/figs (a new folder inside the preprocessed "
         "output: a later preprocess or upgrade_data of DATA refused it)", 2,
         ("--out", "{w}/data/figs", "inside the preprocessed output"),
         lambda w: ["scripts/figures.py", "--weights", str(last(w.ctx)), "--data", str(_data_copy(w)), "--out",
                    str(w.w / "data" / "figs")], _data_unchanged),
    Case("train-refused-leaves-no-run-dir", "lost", "a new run.dir and a data.root that does not exist (the "
         "refusal left run.dir made, holding its .lock)", 2, ("{w}/nope", "does not exist"),
         lambda w: tr(w, data=w.w / "nope", run=w.w / "runs" / "new"), _nothing_at("runs")),
    Case("evaluate-refused-leaves-no-json-folder", "lost", "evaluate.py --json NEW/e.json with weights that do not "
         "load (NEW/ was made, and left)", 2, ("{w}/bad.pt", "cannot be loaded"),
         lambda w: ev(w, "--json", w.w / "new" / "e.json", weights=_users_file(w, "bad.pt")), _nothing_at("new")),
    Case("figures-over-users-filters-png", "lost", "figures.py --out FIGS where FIGS/filters.png is the user's own "
         "image (a name the tool writes there: it was replaced)", 2, ("--out", "'filters.png'", "has this tool's name"),
         lambda w: ["scripts/figures.py", "--weights", str(last(w.ctx)), "--data", str(w.ctx.data()), "--out",
                    str(_users_file(w, "figs/filters.png").parent)], _users_file_unchanged("figs/filters.png")),
    Case("make-synthetic-over-a-foreign-manifest", "lost", "make_synthetic.py --out DATASET holding train/, val/ "
         "and a manifest.json of the user's (every name one of the tree's own: its train/ and val/ were removed)", 2,
         ("--out", "'manifest.json'", "has this tool's name"),
         lambda w: ["scripts/make_synthetic.py", "--out", str(_users_dataset(w)), "--classes", "2"],
         _users_dataset_unchanged),
    Case("preprocess-out-a-raw-dataset", "lost", "preprocess.py --out RAW where RAW holds train/ and val/ of the "
         "user's images in class folders (its own names: the batch files were written among the images)", 2,
         ("--out", "'train'", "not a folder of preprocess's batch files"),
         lambda w: pp("--train-dir", w.ctx.src / "train", "--out", _users_dataset(w, manifest=False)),
         _users_dataset_unchanged),
    Case("preprocess-out-over-a-users-sources-index", "lost", "preprocess.py --out OUT where OUT holds only a "
         "sources_index.json of the user's (its own name: read as no index yet, then replaced by the archives' "
         "index; with folders of images, written beside)", 2,
         ("--out", "'sources_index.json'", "has this tool's name"),
         lambda w: pp("--train-dir", w.ctx.src / "train", "--out", _users_file(w, "out/sources_index.json").parent),
         lambda w: _users_file_unchanged("out/sources_index.json")(w) or (
             None if sorted(p.name for p in (w.w / "out").iterdir()) == ["sources_index.json"]
             else "preprocess wrote into the folder")),
    Case("gpu-check-out-over-a-users-work-folder", "lost", "gpu_check.py --device cpu --out OUT where OUT holds "
         "the user's own work/ folder (its own name: removed at the start of the run, with logs/)", 2,
         ("--out", "'work'", "has this tool's name"),
         lambda w: ["scripts/gpu_check.py", "--device", "cpu", "--quick", "--out",
                    str(_users_file(w, "out/work/thesis.tex").parent.parent)],
         _users_file_unchanged("out/work/thesis.tex")),
]
