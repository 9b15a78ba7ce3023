"""The documents' commands as the tests run them. A test that runs what a page shows takes the command from
the page (`documented`, by its first words) and adds only what this machine needs: its data and a folder
(train.py's later overrides win), tiny sizes, a free port. A page then cannot drift from what the suite runs;
tests/test_doc_commands.py requires every documented CPU training command to be run so."""
from __future__ import annotations

import re
import shlex
import sys

from tests.conftest import REPO


def documents() -> list:
    """README.md, docs/*.md and pretrained/README.md: the pages whose shell blocks are commands."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "pretrained" / "README.md"]


BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
OPTIONAL = re.compile(r"\[(--[^\]]*)\]")  # `[--crops 10]`: an optional part, checked as if given


def documented_commands(pages: list | None = None) -> list[tuple[str, list[str]]]:
    """(where, argv) of every command in the documents' shell blocks: continuations joined, comments and
    a block's VAR="..." assignments applied, `[--option value]` (optional parts) kept as given."""
    found = []
    for doc in pages if pages is not None else documents():
        text = doc.read_text(encoding="utf-8")
        for block in BLOCK.finditer(text):
            line_no = text[:block.start()].count("\n") + 2
            variables: dict[str, str] = {}
            for line in block.group(1).replace("\\\n", " ").splitlines():
                words = shlex.split(OPTIONAL.sub(r" \1 ", line), comments=True)
                if not words:
                    continue
                if len(words) == 1 and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                    name, value = words[0].split("=", 1)
                    variables[name] = value
                    continue
                expanded = [w for word in words for w in
                            (shlex.split(variables[word[1:]]) if word.startswith("$") and word[1:] in variables
                             else [word])]
                found.append((f"{doc.relative_to(REPO)}:{line_no}", expanded))
    return found


def same_run(argv: list[str]) -> tuple[str, ...]:
    """A command without its run.dir: two pages showing one run in two folders show one command."""
    return tuple(w for w in argv if not w.startswith("run.dir="))


def documented(*words: str) -> list[str]:
    """The one documented command whose words start with `words` (a --dry-run of it only if asked for)."""
    found: dict[tuple[str, ...], tuple[str, list[str]]] = {}
    for where, argv in documented_commands():
        if argv[:len(words)] == list(words) and ("--dry-run" in words or "--dry-run" not in argv):
            found.setdefault(same_run(argv), (where, argv))
    assert len(found) == 1, (f"{len(found)} documented commands start with {' '.join(words)!r}: "
                             f"{[where for where, _ in found.values()]}")
    return list(next(iter(found.values()))[1])


def with_overrides(argv: list[str], overrides: list[str]) -> list[str]:
    """`argv` with `overrides` after train.py's documented ones (so they win) and before its flags."""
    at = argv.index("train.py") + 1
    words = [w for w in argv[at:] if not w.startswith("--")]
    flags = [w for w in argv[at:] if w.startswith("--")]
    return [*argv[:at], *words, *overrides, *flags]


def runnable(argv: list[str], port: int | None = None) -> list[str]:
    """`argv` as this machine runs it: `python` is this interpreter, `torchrun` this interpreter's
    torch.distributed.run; with `port`, a rendezvous endpoint's port is it, or torchrun's master port."""
    head = {"python": [sys.executable], "python3": [sys.executable],
            "torchrun": [sys.executable, "-m", "torch.distributed.run"]}[argv[0]]
    rest = list(argv[1:])
    if port is not None and argv[0] == "torchrun":
        endpoint = [i for i, w in enumerate(rest) if w.startswith("--rdzv-endpoint=")]
        if endpoint:
            rest[endpoint[0]] = re.sub(r":\d+$", f":{port}", rest[endpoint[0]])
        else:
            rest.insert(0, f"--master-port={port}")
    return [*head, *rest]
