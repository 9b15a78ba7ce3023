"""Class names (the words of each wnid): from LOC_synset_mapping.txt, the devkit, or any `<wnid> <words>` file.

``meta.json`` records them (``class_names``, aligned with ``classes``) when a source gives them;
evaluation's outputs and ``scripts/predict.py`` print them.
"""
from __future__ import annotations

import os
from pathlib import Path

from .devkit import devkit_words
from .layouts import DataError


def read_synset_mapping(path: str | os.PathLike) -> dict[str, str]:
    """wnid -> words from a text file of `<wnid> <words>` lines (Kaggle's LOC_synset_mapping.txt)."""
    names: dict[str, str] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()  # Windows editors add a BOM
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"class names file {path} is unreadable ({e})") from None
    for lineno, line in enumerate(lines, start=1):
        parts = line.strip().split(maxsplit=1)
        if not parts:
            continue
        if parts[0] in names:
            raise DataError(f"{path}:{lineno}: {parts[0]!r} is listed twice")
        names[parts[0]] = parts[1] if len(parts) > 1 else ""
    if not names:
        raise DataError(f"class names file {path} lists no class ('<wnid> <words>' per line)")
    return names


def read_class_names(path: str | os.PathLike) -> dict[str, str]:
    """wnid -> words from a `<wnid> <words>` file, the devkit (archive or folder) or its meta.mat."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"class names file {p} does not exist")
    name = p.name.lower()
    if p.is_dir() or name.endswith((".mat", ".tar.gz", ".tgz")):
        return devkit_words(p)
    return read_synset_mapping(p)


def names_for(classes: list[str], names: dict[str, str], source: str) -> list[str]:
    """The words of each class, in class order; every class must have an entry."""
    missing = [c for c in classes if c not in names]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DataError(f"{source} gives no words for class(es) {', '.join(missing[:3])}{more}")
    return [names[c] for c in classes]
