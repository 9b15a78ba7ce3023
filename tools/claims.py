"""Every number in README.md, the docs/ task pages and docs/DESIGN.md, and the file it comes from (issue 20).

The documents checked are `DOCS` (the README, the task pages of issue 25, the design page).

`docs/claims.yaml` maps each number a reader relies on to its source. Each entry anchors on a piece of
text (`at`, found exactly once in its document) and names the numbers it covers, written as in the
document, found in the 400 characters from the anchor on. Its `kind` says where they come from:

- `artifact`: a committed JSON file (`source`) and, per number, a `key` (a path such as
  `rows/0/img_per_s`; `scale` multiplies the JSON value first). The document's value must equal the
  JSON's rounded to the decimals the document shows ("~x": within 5 %).
- `arithmetic` (and `model`, a labelled cost model): per number an `expr` (Python arithmetic), checked
  the same way.
- `test`: the test node ids (`source`) that check the statement the numbers belong to.
- `code`: a constant of the code (`source` a file, `pattern` a regex that must occur in it).
- `estimate`, `external` (`source`: paper, vendor sheet, reference repository), `measured-once`
  (`source`: machine and date; a run whose output was not committed), `setting` (a value that defines
  what was run or assumed, not a result).

A table row is an entry whose `at` lies on the row, with `cells`: for each numeric cell (0-based
column), its key or expr; a `table` entry (`at` on the header) covers every row below it. The check
fails (exit 1) on: a number with a unit (times, %, ratios, MB/s, img/s, ...) or a numeric table cell
that no entry covers; an anchor or number not found; a missing artifact; a value that disagrees.

    python tools/claims.py            # the list: every number, its line and its source; problems last
    python tools/claims.py --quiet    # the problems only
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

# libyaml's safe loader where PyYAML was built with it: claims.yaml (80 kB) in a ninth of the time
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/install.md", "docs/preprocessing.md", "docs/training.md", "docs/parallelism.md",
        "docs/evaluation.md", "docs/reliability.md", "docs/benchmarks.md", "docs/gpu.md", "docs/testing.md",
        "docs/DESIGN.md")  # the documents whose numbers must each have a source (docs/claims.yaml's keys)
WINDOW = 400  # characters after an anchor in which its numbers are looked for
APPROXIMATE = 0.05  # a value written "~x" may differ from its source by this much (relative)

_NUM = r"\d(?:[\d,]*\d)?(?:\.\d+)?"
_ATTACHED = r"GB/s|MB/s|img/s|µs|ms|%|KiB|MiB|GiB|GB|MB|TB|×|x"
_SPACED = r"images/s|min|minutes?|s|seconds?|hours?|days?"  # "1s" in prose is not a time
_UNIT = rf"(?:\s?(?:{_ATTACHED})|\s(?:{_SPACED}))"
UNIT_NUMBER = re.compile(rf"(?<![\w.,/-])[~≥≤]?{_NUM}(?:\s?[–-]\s?{_NUM})?{_UNIT}(?![\w/])(?!\s?\d)")
CELL_NUMBER = re.compile(rf"^\**[~≥≤]?{_NUM}\**{_UNIT}?(?: / {_NUM})*(?: \(.*\))?$")
FIRST_NUMBER = re.compile(_NUM)
SAFE_NAMES = {"__builtins__": {}, "math": math, "round": round, "min": min, "max": max, "range": range}


@dataclass
class Number:
    """One number found in a document: where, as written, and what covers it."""

    doc: str
    line: int
    start: int
    text: str
    source: str = ""


def value_of(text: str) -> float:
    """The first number written in `text` (thousands separators dropped)."""
    match = FIRST_NUMBER.search(text.replace("**", ""))
    if match is None:
        raise ValueError(f"no number in {text!r}")
    return float(match.group().replace(",", ""))


def decimals(text: str) -> int:
    """How many decimals the first number of `text` shows: the rounding it states."""
    match = FIRST_NUMBER.search(text.replace("**", ""))
    whole = match.group() if match else ""
    return len(whole.split(".")[1]) if "." in whole else 0


def lookup(data, key: str):
    """The value at `key` (`a/0/b`) in a loaded JSON document."""
    for part in key.split("/"):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def agrees(written: str, actual: float) -> bool:
    """True when `actual` rounded to the decimals of `written` is the value written."""
    step = 10.0 ** -decimals(written)
    slack = APPROXIMATE * abs(actual) if written.lstrip("*").startswith("~") else 0.0
    return abs(value_of(written) - actual) <= step / 2 + slack + 1e-9 * max(1.0, abs(actual))


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def unit_numbers(doc: str, text: str) -> list[Number]:
    """Every number-with-a-unit of a document."""
    return [Number(doc, line_of(text, m.start()), m.start(), m.group().strip()) for m in UNIT_NUMBER.finditer(text)]


def table_cells(doc: str, text: str) -> list[Number]:
    """Every numeric cell of the document's markdown tables (separator rows left out)."""
    found, offset = [], 0
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith("|") and not set(line) <= set("|-: "):
            for cell in line.strip().strip("|").split("|"):
                cell = cell.strip()
                if CELL_NUMBER.match(cell):
                    found.append(Number(doc, number, offset + line.index(cell), cell))
        offset += len(line) + 1
    return found


class Checker:
    """Applies the map to the documents; collects what each number comes from and every problem."""

    def __init__(self, root: Path, claims: dict):
        self.root = root
        self.claims = claims
        self.problems: list[str] = []
        self.covered: dict[tuple[str, int], str] = {}
        self.json_cache: dict[str, object] = {}

    def problem(self, doc: str, line: int, what: str) -> None:
        self.problems.append(f"{doc}:{line}: {what}")

    def artifact(self, source: str):
        if source not in self.json_cache:
            path = self.root / source
            self.json_cache[source] = json.loads(path.read_text()) if path.exists() else None
        return self.json_cache[source]

    def anchor(self, doc: str, text: str, at: str) -> int | None:
        count = text.count(at)
        if count != 1:
            self.problem(doc, 0, f"anchor {at!r} found {count} times (must be once)")
            return None
        return text.index(at)

    def expected(self, entry: dict, spec, doc: str, line: int) -> float | None:
        """The value a number or cell must show, from its artifact key or its expression."""
        kind = entry.get("kind")
        if kind in ("arithmetic", "model"):
            expr = spec["expr"] if isinstance(spec, dict) else spec
            return float(eval(expr, SAFE_NAMES))  # noqa: S307 -- our own map, arithmetic only
        if kind != "artifact":
            return None
        data = self.artifact(entry["source"])
        if data is None:
            return None  # reported once by sources_exist
        if isinstance(spec, dict) and "expr" in spec:  # a figure derived from the artifact's values
            names = dict(SAFE_NAMES, v=lambda key: float(lookup(data, self.keyed(entry, key))))
            return float(eval(spec["expr"], names))  # noqa: S307 -- our own map, arithmetic only
        key, scale = (spec["key"], spec.get("scale", 1.0)) if isinstance(spec, dict) else (spec, 1.0)
        key = self.keyed(entry, key)
        try:
            return float(lookup(data, key)) * scale
        except (KeyError, IndexError, TypeError, ValueError):
            self.problem(doc, line, f"{entry['source']} has no number at {key!r}")
            return None

    @staticmethod
    def keyed(entry: dict, key: str) -> str:
        """A key relative to the entry's `row` (a table row's object in the artifact)."""
        return f"{entry['row']}/{key}" if "row" in entry else key

    def sources_exist(self, doc: str, line: int, entry: dict) -> None:
        """`test` ids must name a test that exists; `code` patterns must occur in their file."""
        kind, sources = entry.get("kind"), entry.get("source", [])
        if kind == "test":
            for node in [sources] if isinstance(sources, str) else sources:
                path, _, name = node.partition("::")
                file = self.root / path
                if not file.exists() or f"def {name.split('[')[0]}(" not in file.read_text():
                    self.problem(doc, line, f"test {node} does not exist")
        elif kind == "code":
            file = self.root / sources
            if not file.exists() or not re.search(entry["pattern"], file.read_text()):
                self.problem(doc, line, f"{sources} does not hold {entry['pattern']!r}")
        elif kind == "artifact" and not (self.root / sources).exists():
            self.problem(doc, line, f"artifact {sources} does not exist")

    def compare(self, entry: dict, spec, written: str, doc: str, line: int) -> None:
        actual = self.expected(entry, spec, doc, line)
        if actual is not None and not agrees(written, actual):
            self.problem(doc, line, f"{written!r} disagrees with {describe(entry, spec)} = {actual:g}")

    def cover(self, doc: str, start: int, length: int, source: str) -> None:
        for offset in range(start, start + max(length, 1)):
            self.covered[(doc, offset)] = source

    def apply(self, doc: str, text: str, entry: dict) -> None:
        start = self.anchor(doc, text, entry["at"])
        if start is None:
            return
        line = line_of(text, start)
        label = describe(entry)
        self.sources_exist(doc, line, entry)
        if entry.get("table"):
            end = text.find("\n\n", start)
            self.cover(doc, start, (len(text) if end < 0 else end) - start, label)
        if "cells" in entry:
            self.apply_cells(doc, text, entry, start, line)
        window = text[start:start + len(entry["at"]) + WINDOW]
        for spec in entry.get("numbers", []):
            written = spec if isinstance(spec, str) else spec["text"]
            found = window.find(written)
            if found < 0:
                self.problem(doc, line, f"{written!r} not found after {entry['at']!r} (the map says it is there)")
                continue
            self.cover(doc, start + found, len(written), label if isinstance(spec, str) else describe(entry, spec))
            if not isinstance(spec, str):
                self.compare(entry, spec, written, doc, line)

    def apply_cells(self, doc: str, text: str, entry: dict, start: int, line: int) -> None:
        row_start = text.rfind("\n", 0, start) + 1
        row = text[row_start:text.find("\n", start)]
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        for column, spec in entry["cells"].items():
            column = int(column)
            if column >= len(cells) or not FIRST_NUMBER.search(cells[column]):
                self.problem(doc, line, f"column {column} of the row at {entry['at']!r} holds no number")
                continue
            specs = spec if isinstance(spec, list) else [spec]  # "a / b / c": one spec per number
            source = " | ".join(describe(entry, one) for one in specs)
            self.cover(doc, row_start + row.index(cells[column]), len(cells[column]), source)
            parts = cells[column].split(" / ") if len(specs) > 1 else [cells[column]]
            if len(parts) != len(specs):
                self.problem(doc, line, f"{cells[column]!r} holds {len(parts)} numbers, the map {len(specs)}")
                continue
            for part, one in zip(parts, specs):
                self.compare(entry, one, part, doc, line)

    def run(self, docs: dict[str, str]) -> list[Number]:
        for doc, text in docs.items():
            for entry in self.claims.get(doc, []):
                self.apply(doc, text, entry)
        numbers = []
        for doc, text in docs.items():
            seen = set()
            for number in unit_numbers(doc, text) + table_cells(doc, text):
                if number.start in seen:
                    continue
                seen.add(number.start)
                number.source = self.covered.get((doc, number.start), "")
                if not number.source:
                    self.problem(doc, number.line, f"{number.text!r} has no source in docs/claims.yaml")
                numbers.append(number)
        return sorted(numbers, key=lambda n: (n.doc, n.start))


def describe(entry: dict, spec=None) -> str:
    """One short label of where a number comes from."""
    kind = entry.get("kind", "?")
    if isinstance(spec, dict) and "expr" in spec:
        return f"{entry.get('source', 'arithmetic')}: {spec['expr']}"
    if spec is not None and kind == "artifact":
        key = spec["key"] if isinstance(spec, dict) else spec
        return f"{entry['source']}:{Checker.keyed(entry, key)}"
    if spec is not None and kind in ("arithmetic", "model"):
        return f"arithmetic: {spec}"
    source = entry.get("source", "")
    return f"{kind}: {source}" if source else kind


def check(root: Path = ROOT, claims_file: Path | None = None,
          docs: tuple[str, ...] = DOCS) -> tuple[list[Number], list[str]]:
    """Every number of `docs` with its source, and the problems found."""
    claims = yaml.load((claims_file or root / "docs" / "claims.yaml").read_text(), Loader=SAFE_LOADER)
    texts = {doc: (root / doc).read_text(encoding="utf-8") for doc in docs}
    checker = Checker(root, claims)
    numbers = checker.run(texts)
    return numbers, checker.problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="List every number of README.md, the docs/ task pages and "
                                                 "docs/DESIGN.md with its source (docs/claims.yaml); exit 1 if "
                                                 "one is unmapped or disagrees with its artifact.")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    parser.add_argument("--claims", type=Path, default=None, help="the map (default: ROOT/docs/claims.yaml)")
    parser.add_argument("--quiet", action="store_true", help="print the problems only")
    args = parser.parse_args(argv)
    numbers, problems = check(args.root, args.claims)
    if not args.quiet:
        for n in numbers:
            print(f"{n.doc}:{n.line}\t{' '.join(n.text.split())}\t{n.source or 'UNMAPPED'}")
    for p in problems:
        print(f"claims: {p}", file=sys.stderr)
    print(f"claims: {len(numbers)} numbers, {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from alexnet.cli import protect_streams  # here: a test imports this module without the repository's path
    protect_streams("claims.py")  # `| head`: a reader that went away is not an error
    sys.exit(main())
