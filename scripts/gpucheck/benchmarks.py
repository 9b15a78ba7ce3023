"""scripts/benchmark.py train / loading / exchange as steps (full size on a GPU); their --json figures
go into the report, one table each."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable

from .commands import check
from .context import Ctx, Outcome


def bench_args(ctx: Ctx, kind: str) -> list[str]:
    flags = list(ctx.profile.bench[kind])
    if kind == "exchange":  # 2 replicas: on 2 GPUs if there are, else sharing the one (or the CPU)
        devices = ["cpu", "cpu"] if ctx.device == "cpu" else ["cuda:0", "cuda:1" if ctx.gpus > 1 else "cuda:0"]
        return [*flags, "--replicas", "2", "--devices", *devices]
    return [*flags, "--device", ctx.device]


def bench_step(kind: str) -> Callable[[Ctx], Outcome]:
    """A step running `scripts/benchmark.py kind` and keeping its --json figures."""
    def step(ctx: Ctx) -> Outcome:
        out = ctx.work / ctx.step / f"{kind}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        check(ctx, kind, [sys.executable, "scripts/benchmark.py", kind, *bench_args(ctx, kind), "--json", str(out)])
        result = json.loads(out.read_text())
        return Outcome(bench_summary(result), result)
    step.__doc__ = f"scripts/benchmark.py {kind}"
    return step


def bench_summary(result: dict) -> str:
    """One line of a benchmark's figures for the steps table (the full tables follow it)."""
    rows = result["rows"]
    if result["benchmark"] == "train":
        best = max(rows, key=lambda r: r["img_per_s"])
        return (f"fp32 {rows[0]['img_per_s']} img/s; best {best['precision']}"
                f"{' channels_last' if best['channels_last'] else ''} {best['img_per_s']} img/s "
                f"({best['vs_fp32']}x), batch {result['batch_size']}")
    if result["benchmark"] == "loading":
        return "; ".join(f"{r['what'].replace('data.loading=', '')} {r['vs_upper_bound']}" for r in rows[1:4]) + \
            " of the upper bound"
    return "; ".join(f"{r['what']} {r['ms']} ms" for r in rows)


def md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(rows: list[dict]) -> list[str]:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(md_cell(r.get(c, "")) for c in cols) + " |" for r in rows]


def bench_section(name: str, what: str, figures: dict) -> list[str]:
    """A passed benchmark's figures as markdown: what it ran with, its rows (and the paper's Table 1)."""
    about = ", ".join(f"{k} {v}" for k, v in figures.items() if k not in ("rows", "table1", "benchmark"))
    lines = [f"### {name}: {what}", "", about, "", *md_table(figures["rows"]), ""]
    if figures.get("table1"):
        lines += ["Table 1 layout:", "", *md_table(figures["table1"]), ""]
    return lines
