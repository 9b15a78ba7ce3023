"""The outcomes as a terminal line each, a markdown table and a JSON record."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .core import KINDS, Outcome

VERDICTS = ("OK", "WEAK", "DEFECT", "SKIP")
_WIDTH = 160  # characters of a message kept in the markdown table


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    c = Counter(o.verdict for o in outcomes)
    return {v: c.get(v, 0) for v in VERDICTS}


def summary(outcomes: list[Outcome]) -> str:
    return f"{len(outcomes)} cases: " + ", ".join(f"{n} {v}" for v, n in counts(outcomes).items())


def exit_text(o: Outcome) -> str:
    got = "-" if o.code is None else str(o.code)
    return got if o.code == o.case.expect else f"{got} (expected {o.case.expect})"


def line(o: Outcome) -> str:
    """One terminal line: verdict, case, exit, message, reason."""
    reason = f"  [{o.reason}]" if o.reason else ""
    return f"{o.verdict:6} {o.case.name:34} exit {exit_text(o):16} {o.message[:_WIDTH]}{reason}"


def _cell(text: str) -> str:
    text = text if len(text) <= _WIDTH else text[:_WIDTH - 1] + "…"
    return text.replace("|", "\\|").replace("`", "'")


def markdown(outcomes: list[Outcome], command: str, date: str) -> str:
    """The table: one row per case, issue 19's instances marked, then the counts."""
    rows = ["| case | kind | fault | exit | first line of the message | verdict |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        verdict = f"**{o.verdict}**" + (f": {_cell(o.reason)}" if o.reason else "")
        name = f"`{o.case.name}`" + (" (issue)" if o.case.listed else "")
        rows.append(f"| {name} | {KINDS[o.case.kind]} | {_cell(o.case.what)} | {exit_text(o)} | "
                    f"`{_cell(o.message)}` | {verdict} |")
    return (f"`{command}` on {date}: {summary(outcomes)}. W is the work folder; (issue): an instance issue 19 "
            "lists.\n\n" + "\n".join(rows) + "\n")


def record(outcomes: list[Outcome], command: str, date: str) -> dict:
    return {"command": command, "date": date, "counts": counts(outcomes),
            "cases": [{"case": o.case.name, "kind": o.case.kind, "issue": o.case.listed, "fault": o.case.what,
                       "expected_exit": o.case.expect, "exit": o.code, "message": o.message, "verdict": o.verdict,
                       "reason": o.reason, "seconds": round(o.seconds, 2)} for o in outcomes]}


def write(path: str | None, text: str) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


def write_json(path: str | None, obj: dict) -> None:
    write(path, json.dumps(obj, indent=1) + "\n")
