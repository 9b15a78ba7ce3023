"""The documents a user reads (issue 25): every link resolves, the README stays short and gives the commands.

Checked documents: README.md, docs/*.md and pretrained/README.md. A link is `[text](target)` or
`![alt](target)` (outside code blocks) or a reference definition `[label]: target`. A relative target
must be a file or folder of the repository (relative to the document; `/x` from the repository root);
an anchor (`target.md#anchor`, or `#anchor` in the same page) must be a heading of that Markdown file
under GitHub's slug rules, or an `<a id=...>`/`<a name=...>` there. http(s) and mailto links are not
fetched. Each check is also run once on a damaged copy, to see it fail.
"""
from __future__ import annotations

import os
import re
import shutil
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = re.compile(r"^(?:https?:|mailto:|ftp:)", re.IGNORECASE)


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown pages a user reads."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "pretrained" / "README.md"]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text outside fenced code blocks."""
    kept, fence = [], None
    for number, line in enumerate(text.split("\n"), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)[0] * len(match.group(1))
        elif fence is not None and line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
            fence = None
        elif fence is None:
            kept.append((number, line))
    return kept


def code_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks."""
    blocks, current, fence = [], [], None
    for line in text.split("\n"):
        match = FENCE.match(line)
        if fence is None and match:
            fence, current = match.group(1)[0] * len(match.group(1)), []
        elif fence is not None and line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
            blocks.append("\n".join(current))
            fence = None
        elif fence is not None:
            current.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its rendered text lower-cased, every character that is not a
    letter, a mark, a digit, `_`, a space or a hyphen dropped, and each space made a hyphen."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags render as nothing
    kept = "".join(c for c in text.lower()
                   if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown page offers: its headings' slugs (the n-th repeat gets -n) and HTML ids."""
    found, seen = set(), {}
    for _, line in prose_lines(text):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(HTML_ANCHOR.findall(line))
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link of a page outside code blocks."""
    found = []
    for number, line in prose_lines(text):
        found += [(number, m.group(2)) for m in INLINE_LINK.finditer(line)]
        reference = REFERENCE.match(line)
        if reference and not INLINE_LINK.search(line):
            found.append((number, reference.group(1)))
    return found


def broken_links(root: Path = ROOT, docs: list[Path] | None = None) -> list[str]:
    """`doc:line: target: why` for every link that does not resolve."""
    problems, cache = [], {}

    def anchors_of(path: Path) -> set[str]:
        if path not in cache:
            cache[path] = anchors(path.read_text(encoding="utf-8"))
        return cache[path]

    for doc in docs or documents(root):
        text = doc.read_text(encoding="utf-8")
        for number, target in links(text):
            where = f"{doc.relative_to(root)}:{number}: {target}"
            if not target:
                problems.append(f"{where}: empty target")
                continue
            if EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            path_part = unquote(path_part)
            if path_part.startswith("/"):
                path = root / path_part.lstrip("/")
            else:
                path = doc.parent / path_part if path_part else doc
            if not path.exists():
                problems.append(f"{where}: no such file or folder")
                continue
            if not Path(os.path.normpath(path)).is_relative_to(root):
                problems.append(f"{where}: outside the repository")
                continue
            if anchor:
                if path.suffix.lower() != ".md" or path.is_dir():
                    problems.append(f"{where}: an anchor into a file that is not Markdown")
                elif unquote(anchor) not in anchors_of(path):
                    problems.append(f"{where}: {path.relative_to(root)} has no heading #{anchor}")
    return problems


def commands(text: str) -> list[str]:
    """Every command a page shows: the lines of its code blocks (a trailing backslash joins the next
    line) and its inline code spans."""
    found = []
    for block in code_blocks(text):
        found += [line.strip() for line in re.sub(r"\\\n\s*", " ", block).split("\n") if line.strip()]
    for _, line in prose_lines(text):
        found += re.findall(r"`([^`]+)`", line)
    return found


def evaluates(weights: str):
    """A predicate: an evaluate.py command whose --weights names `weights`."""
    return lambda c: c.startswith("python scripts/evaluate.py") and re.search(rf"--weights \S*{re.escape(weights)}", c)


# What a new user must find in the README alone (issue 25), each as a predicate on one command.
REQUIRED = {
    "the demo": lambda c: c.split("#")[0].split() == ["make", "demo"],
    "the tests": lambda c: c.split("#")[0].split() == ["make", "test"],
    "preprocessing the official ImageNet files": lambda c: c.startswith("python scripts/preprocess.py") and all(
        f in c for f in ("--train-dir ILSVRC2012_img_train.tar", "--val-dir ILSVRC2012_img_val.tar",
                         "--val-labels ILSVRC2012_devkit_t12.tar.gz", "--out ")),
    "training on 1 GPU": lambda c: c.startswith("python train.py configs/alexnet_1gpu.yaml"),
    "training on 8 GPUs": lambda c: re.match(r"python train\.py configs/alexnet_8gpu_\w+\.yaml", c) is not None,
    "training on 2 hosts": lambda c: c.startswith("torchrun --nnodes=2 ") and "train.py configs/" in c,
    "evaluating a training run": evaluates("runs/"),
    "evaluating torchvision's weights": evaluates("torchvision"),
    "evaluating BVLC's AlexNet": evaluates("bvlc_alexnet "),
    "evaluating BVLC's CaffeNet": evaluates("bvlc_reference_caffenet "),
    "evaluating the Theano reproduction's weights": evaluates("parameters_releasing"),
}


def readme_too_long(root: Path) -> list[str]:
    """A problem when README.md has more than README_MAX_LINES lines (as `wc -l` counts them)."""
    lines = (root / "README.md").read_text(encoding="utf-8").count("\n")
    if lines <= README_MAX_LINES:
        return []
    return [f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"]


def missing_commands(readme: str) -> list[str]:
    shown = commands(readme)
    return [what for what, given in REQUIRED.items() if not any(given(c) for c in shown)]


def missing_files_in_commands(root: Path, readme: str) -> list[str]:
    """Scripts and configs that the README's commands name but the repository lacks."""
    named = {m for c in commands(readme) for m in re.findall(r"(?:scripts|configs|tools)/[\w./-]+\.(?:py|yaml|sh)", c)}
    return sorted(n for n in named if not (root / n).exists())


def test_slug_follows_githubs_rules():
    assert slug("What is proven where") == "what-is-proven-where"
    assert slug("2 GPUs / 8 GPUs") == "2-gpus--8-gpus"
    assert slug("Reading speed, and what a real run needs from its disk") == \
        "reading-speed-and-what-a-real-run-needs-from-its-disk"
    assert slug("The Theano reproduction's weights") == "the-theano-reproductions-weights"
    assert slug("Testing: how tests fail (`tests/`, `tools/claims.py`)") == "testing-how-tests-fail-tests-toolsclaimspy"
    assert slug("What `make` installs") == "what-make-installs"
    assert slug("Do the tests catch bugs?") == "do-the-tests-catch-bugs"
    assert slug("see [the page](docs/x.md) now") == "see-the-page-now"
    assert slug("snake_case and 2 × 128") == "snake_case-and-2--128"
    assert slug("Überblick") == "überblick"


def test_repeated_headings_get_numbered_anchors_and_code_blocks_hold_none():
    text = "# A\n\n## Tested\n\n```bash\n# not a heading\n```\n\n## Tested\n\n### Tested\n<a id=\"here\"></a>\n"
    assert anchors(text) == {"a", "tested", "tested-1", "tested-2", "here"}


def test_links_are_found_outside_code_only():
    text = ("See [a](x.md#b) and ![img](f.png), [`c`](c.md).\n\n```\n[not](a-link.md)\n```\n"
            "[ref]: docs/y.md\n[site](https://example.org)\n")
    assert [t for _, t in links(text)] == ["x.md#b", "f.png", "c.md", "docs/y.md", "https://example.org"]


def test_every_link_of_the_docs_resolves():
    assert broken_links() == []


def test_the_readme_is_short():
    assert readme_too_long(ROOT) == []


def test_the_readme_gives_every_command_a_new_user_needs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert missing_commands(readme) == []
    assert missing_files_in_commands(ROOT, readme) == []


# The checks above, each run on a damaged copy: they must fail.

def copy_of_the_docs(tmp_path: Path) -> Path:
    """A root whose README.md, docs/ and pretrained/ are copies (to damage); the rest links to this checkout."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copytree(ROOT / "pretrained", root / "pretrained")
    for entry in ROOT.iterdir():
        if not (root / entry.name).exists() and entry.name not in (".git", ".venv"):
            os.symlink(entry, root / entry.name)
    return root


def damage(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) >= 1, old
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def test_a_broken_link_fails(tmp_path):
    root = copy_of_the_docs(tmp_path)
    assert broken_links(root) == []
    damage(root / "docs" / "training.md", "](preprocessing.md)", "](preprocesing.md)")
    problems = broken_links(root)
    assert len(problems) == 1 and "docs/training.md" in problems[0] and "no such file" in problems[0], problems


def test_a_wrong_anchor_fails(tmp_path):
    root = copy_of_the_docs(tmp_path)
    damage(root / "README.md", "(docs/training.md#configs)", "(docs/training.md#config)")
    damage(root / "docs" / "gpu.md", "(../README.md#what-is-proven-where)", "(../README.md#what-is-proven)")
    problems = broken_links(root)
    assert any("docs/training.md has no heading #config" in p for p in problems), problems
    assert any("README.md has no heading #what-is-proven" in p for p in problems), problems
    damage(root / "docs" / "reliability.md", "## The fault table", "## The faults table")  # the heading moves
    assert any("no heading #the-fault-table" in p for p in broken_links(root))


def test_a_long_readme_fails(tmp_path):
    root = copy_of_the_docs(tmp_path)
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8")
    readme.write_text(text + "\n" * (README_MAX_LINES - text.count("\n")), encoding="utf-8")
    assert readme_too_long(root) == []  # 250 lines: still short enough
    readme.write_text(readme.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    assert readme_too_long(root) == [f"README.md has 251 lines; move detail to docs/ (at most {README_MAX_LINES})"]


def test_a_missing_command_fails():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert missing_commands(readme.replace("torchrun --nnodes=2", "torchrun --nnodes=4")) == ["training on 2 hosts"]
    assert missing_commands(readme.replace("ILSVRC2012_devkit_t12.tar.gz", "LOC_val_solution.csv")) == \
        ["preprocessing the official ImageNet files"]
    assert missing_commands(readme.replace("--weights bvlc_reference_caffenet ", "--weights caffenet.pt ")) == \
        ["evaluating BVLC's CaffeNet"]
    assert missing_commands(readme.replace("make test", "make check")) == ["the tests"]
    renamed = readme.replace("configs/alexnet_8gpu_fc.yaml", "configs/alexnet_8gpu.yaml")
    assert missing_files_in_commands(ROOT, renamed) == ["configs/alexnet_8gpu.yaml"]
