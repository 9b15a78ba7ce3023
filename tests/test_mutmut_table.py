"""tools/mutmut_table.py: the per-module score counted by hand."""
from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def _table():
    spec = importlib.util.spec_from_file_location("mutmut_table", REPO / "tools" / "mutmut_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_score_counts_timeouts_as_detected_and_leaves_out_the_equivalent(tmp_path, capsys):
    doc = tmp_path / "MUTANTS.md"
    doc.write_text("| `a.b.x_f__mutmut_3` | equivalent: why |\n| `a.b.x_f__mutmut_4` | left: why |\n")
    lines = ["    a.b.x_f__mutmut_1: killed\n", "    a.b.x_f__mutmut_2: timeout\n",
             "    a.b.x_f__mutmut_3: survived\n", "    a.b.x_f__mutmut_4: survived\n",
             "    a.b.xǁCǁm__mutmut_1: killed\n", "    c.x_g__mutmut_1: survived\n"]
    assert _table().main(["a.b.*"], lines, doc) == 0
    out = capsys.readouterr().out.splitlines()
    # a.b: 5 mutants, 3 detected (2 killed, 1 timeout), 1 equivalent: 3 / 4 = 75.0 %; c.* not asked for
    assert out[1] == "a.b | 5 | 2 | 2 | 1 | 0 | 0 | 1 | 75.0 %"
    assert out[2] == "total | 5 | 2 | 2 | 1 | 0 | 0 | 1 | 75.0 %"
    assert out[5:] == ["  E a.b.x_f__mutmut_3: survived", "    a.b.x_f__mutmut_4: survived"]
