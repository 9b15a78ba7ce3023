"""The data every other step reads, and the gpu-marked tests."""
from __future__ import annotations

import json
import re
import sys

from .commands import check, last_line, run_cmd
from .context import Ctx, Outcome, StepFailed


def step_data(ctx: Ctx) -> Outcome:
    """A synthetic ImageNet-format tree (with its file quirks), preprocessed; every other step's input."""
    p, src = ctx.profile, ctx.work / "src"
    check(ctx, "make_synthetic", [sys.executable, "scripts/make_synthetic.py", "--out", str(src), "--classes",
                                  str(p.classes), "--train-per-class", str(p.train_per_class), "--val-per-class",
                                  str(p.val_per_class), "--min-side", str(p.min_side), "--max-side", str(p.max_side)])
    check(ctx, "preprocess", [sys.executable, "scripts/preprocess.py", "--train-dir", str(src / "train"),
                              "--val-dir", str(src / "val"), "--val-labels", str(src / "LOC_val_solution.csv"),
                              "--out", str(ctx.data), "--size", str(p.size), "--per-file", str(p.per_file),
                              "--quiet"])
    counts = {s: v["count"] for s, v in json.loads((ctx.data / "meta.json").read_text())["splits"].items()}
    return Outcome(f"{counts['train']} train, {counts['val']} val images of {p.size} px, {p.classes} classes",
                   {"counts": counts, "image_size": p.size, "classes": p.classes})


def pytest_counts(output: str) -> dict[str, int]:
    """{'passed': 3, 'skipped': 1, ...} from pytest's final summary line ({} if there is none)."""
    for line in reversed(output.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b", line)
        if found and (" in " in line or "no tests ran" in line):
            return {("error" if kind.startswith("error") else kind): int(n) for n, kind in found}
    return {}


def step_pytest(ctx: Ctx) -> Outcome:
    """The gpu-marked tests (tests/test_gpu.py and the cuda:0 twins of tests/test_loader.py)."""
    done = run_cmd(ctx, "pytest", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"])
    counts = pytest_counts(done.output)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or last_line(done.output)
    if done.rc != 0 or counts.get("failed") or counts.get("error"):
        raise StepFailed(f"pytest exited with code {done.rc}: {summary}")
    if not counts.get("passed"):
        raise StepFailed(f"no gpu-marked test passed ({summary})")
    return Outcome(summary, counts)
