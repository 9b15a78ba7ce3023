"""The per-module table of a mutmut run (`make mutants`), then every mutant that was not killed.

    mutmut results --all true | python tools/mutmut_table.py 'alexnet.optim.*' ...

Only the mutants whose names match one of the patterns (fnmatch, as `mutmut run` takes them) count.
Score: (killed + timeout) / (mutants - equivalent), the equivalent ones being those docs/MUTANTS.md
lists as "equivalent" (its table rows starting with the mutant's name in backquotes). A timeout is a
mutant that made its tests hang (a loop that no longer ends): the suite does not pass it either.
"""
from __future__ import annotations

import fnmatch
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "MUTANTS.md"
STATUSES = ("killed", "survived", "timeout", "no tests", "not checked")


def module_of(name: str) -> str:
    """'data.augment.xǁNormalizerǁ_gather__mutmut_3' -> 'data.augment'."""
    return re.split(r"\.x[_ǁ]", name, maxsplit=1)[0]


def equivalents(doc: Path = DOC) -> set[str]:
    """Mutant names judged equivalent in the doc: lines like "| `NAME` | equivalent: why |"."""
    if not doc.is_file():
        return set()
    return set(re.findall(r"^\| `([^`]+)` \| equivalent", doc.read_text(), flags=re.MULTILINE))


def main(patterns: list[str], lines: list[str], doc: Path = DOC) -> int:
    results = {}
    for line in lines:
        name, sep, status = line.strip().rpartition(": ")
        if sep and any(fnmatch.fnmatch(name, p) for p in patterns or ["*"]):
            results[name] = status
    equivalent = equivalents(doc)
    counts: dict[str, Counter] = defaultdict(Counter)
    for name, status in results.items():
        counts[module_of(name)][status] += 1
        counts[module_of(name)]["equivalent"] += name in equivalent and status != "killed"
    header = ["module", "mutants", *STATUSES, "equivalent", "score"]
    print(" | ".join(header))
    for module in sorted(counts) + ["total"]:
        c = sum(counts.values(), Counter()) if module == "total" else counts[module]
        total = sum(c[s] for s in STATUSES)
        judged = total - c["equivalent"]
        score = f"{100 * (c['killed'] + c['timeout']) / judged:.1f} %" if judged else "-"
        print(" | ".join([module, str(total), *(str(c[s]) for s in STATUSES), str(c["equivalent"]), score]))
    left = sorted(n for n, s in results.items() if s not in ("killed", "timeout"))
    print(f"\nnot killed ({len(left)}; 'E': listed as equivalent in {DOC.name}):")
    for name in left:
        print(f"  {'E' if name in equivalent else ' '} {name}: {results[name]}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(DOC.parents[1]))
    from alexnet.cli import protect_streams
    protect_streams("mutmut_table.py")  # `| head`: a reader that went away is not an error
    sys.exit(main(sys.argv[1:], sys.stdin.readlines()))
