"""tools/claims.py: every number of README.md, the docs/ task pages and docs/DESIGN.md has a source, and agrees
with it."""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests import children
from tools import claims

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.processes
def test_every_number_of_the_docs_has_a_source_that_agrees():
    r = children.run([sys.executable, "tools/claims.py", "--quiet"], cwd=ROOT, cpu_s=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""


def test_the_listing_names_each_numbers_source():
    numbers, problems = claims.check(ROOT)
    assert not problems
    by_text = {(n.doc, n.text): n.source for n in numbers}
    assert by_text[("docs/preprocessing.md", "5,526")] == "docs/benchmarks/read_cpu.json:rows/0/img_per_s"
    assert by_text[("docs/training.md", "1,617 ms")] == "docs/benchmarks/checkpoint_cpu.json:rows/0/step_loop_ms"
    assert by_text[("README.md", "1,617 ms")] == "docs/benchmarks/checkpoint_cpu.json:rows/0/step_loop_ms"
    assert by_text[("README.md", "41,157 img/s")] == "docs/benchmarks/read_cpu.json:rows/3/img_per_s"


def test_every_document_of_the_map_is_checked_and_every_checked_document_exists():
    """An entry filed under a page that claims.py does not read would never be checked."""
    mapped = set(yaml.safe_load((ROOT / "docs" / "claims.yaml").read_text()))
    assert mapped == set(claims.DOCS)
    assert all((ROOT / doc).exists() for doc in claims.DOCS)


def test_numbers_with_units_are_found_and_others_are_not():
    text = ("fp32 150 img/s, channels_last 1.26×; ~200 ms instead of ~20 ms; 8-13 min; 3–7 GB/s; 17 %;\n"
            "Python 3.11, torch 2.13, 256×256×3 images, leading 1s are dropped, 2 × 128, 5e-4, R = 2.")
    found = [n.text for n in claims.unit_numbers("X", text)]
    assert found == ["150 img/s", "1.26×", "~200 ms", "~20 ms", "8-13 min", "3–7 GB/s", "17 %"]


def test_values_agree_at_the_rounding_the_document_shows():
    assert claims.agrees("5,526", 5526.4) and not claims.agrees("5,526", 5526.6)
    assert claims.agrees("0.10", 0.095) and claims.agrees("**41,157**", 41157)
    assert claims.agrees("30.5 ms", 30.48) and not claims.agrees("31", 30.48)
    assert claims.agrees("~800 MB", 805.3) and not claims.agrees("800 MB", 805.3)


def copy_of_the_repository(tmp_path: Path) -> Path:
    """A root whose README.md and docs/ are copies (to damage); the rest links to this checkout."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copytree(ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("figures"))
    for name in ("alexnet", "data", "scripts", "tools", "tests", "configs"):
        os.symlink(ROOT / name, root / name)
    return root


def problems_after(root: Path, old: str, new: str, doc: str = "README.md") -> list[str]:
    path = root / doc
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new), encoding="utf-8")
    return claims.check(root)[1]


@pytest.mark.processes
def test_a_wrong_number_in_a_table_row_fails(tmp_path):
    root = copy_of_the_repository(tmp_path)
    assert claims.check(root)[1] == []
    problems = problems_after(root, "| 256 | 5,526 |", "| 256 | 5,562 |", doc="docs/preprocessing.md")
    assert any("'5,562' disagrees with docs/benchmarks/read_cpu.json:rows/0/img_per_s = 5526" in p for p in problems)
    r = children.run([sys.executable, str(ROOT / "tools/claims.py"), "--quiet", "--root", str(root)],
                       cpu_s=60)
    assert r.returncode == 1 and "5,562" in r.stderr


def test_the_cost_models_old_31_ms_fails(tmp_path):
    """The cell issue 20 found: 31 ms here against 30.5 ms in the other table (30.48 by the formula)."""
    problems = problems_after(copy_of_the_repository(tmp_path), "| 30 / 61 / 122 |", "| 31 / 61 / 122 |",
                              doc="docs/parallelism.md")
    assert any("'31' disagrees" in p for p in problems), problems


@pytest.mark.parametrize("doc, heading", [("README.md", "## Quick start\n"), ("docs/install.md", "## The demo\n"),
                                          ("docs/parallelism.md", "## Several hosts\n")])
def test_a_number_without_a_source_fails(tmp_path, doc, heading):
    problems = problems_after(copy_of_the_repository(tmp_path), heading,
                              heading + "\nIt trains AlexNet in 12.5 ms per step.\n", doc=doc)
    assert any(p.startswith(f"{doc}:") and "'12.5 ms' has no source" in p for p in problems), problems


def test_a_prose_number_changed_fails(tmp_path):
    problems = problems_after(copy_of_the_repository(tmp_path), "takes 1,649 ms beside", "takes 1,469 ms beside",
                              doc="docs/training.md")
    assert any("'1,649 ms' not found" in p for p in problems)
    assert any("'1,469 ms' has no source" in p for p in problems)


def test_an_artifact_that_changed_or_went_missing_fails(tmp_path):
    root = copy_of_the_repository(tmp_path)
    path = root / "docs/benchmarks/checkpoint_cpu.json"
    data = json.loads(path.read_text())
    data["rows"][1]["step_loop_ms"] = 175.0
    path.write_text(json.dumps(data))
    assert any("'162 ms' disagrees" in p for p in claims.check(root)[1])
    (root / "docs/benchmarks/train_cpu.json").unlink()
    assert any("artifact docs/benchmarks/train_cpu.json does not exist" in p for p in claims.check(root)[1])


def test_a_test_named_as_a_source_must_exist(tmp_path):
    root = copy_of_the_repository(tmp_path)
    problems = problems_after(root, "test_plan_cuts_a_step_to_the_budget_or_skips_it",
                              "test_plan_cuts_a_step_that_is_gone", doc="docs/claims.yaml")
    assert any("test tests/test_gpu_check.py::test_plan_cuts_a_step_that_is_gone does not exist" in p
               for p in problems)
