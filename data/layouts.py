"""ImageNet source layouts: canonical image names, classes, and the validation label formats.

Every source of a split (a folder, a tar, gzip shards: see :mod:`data.archives`) is first turned into a
:class:`Listing` of canonically named entries: ``<wnid>/<file>`` for class-sorted images (a class folder,
a per-class inner tar, a Hugging Face ``<stem>_<wnid>`` name) and the bare file name for flat
validation images. The plan, the batch files' ``names`` and ``plan.json``'s digest use these names, so
the same images give the same output whichever form they come in.

Classes are the sorted wnids and a label is the index in that order (the torchvision/Caffe convention).
Flat validation images are labelled by a file (:mod:`data.val_labels`): Kaggle's ``LOC_val_solution.csv``,
a Caffe-style ``val.txt``, or the devkit (:mod:`data.devkit`); every labeller gives a wnid per image.

Everything here only lists files; nothing is decoded. Problems that would make the whole run wrong
(missing folders, no classes, label files naming unknown files or classes, a folder reached twice
through a link) raise :class:`DataError` before any work; single odd files are returned as ``ignored``
with the reason, never dropped silently. A file name that is not valid UTF-8 is named by its escaped
form (:func:`printable`) everywhere: plan digest, batch files, report.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_EXTS = frozenset({".jpeg", ".jpg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"})


class DataError(ValueError):
    """Input that cannot be used: names the file, key or value at fault."""


@dataclass(frozen=True)
class Item:
    """One source image: its canonical name, its label, and where its bytes are (None: a file below the
    split folder, at `path`; else an archive member of :mod:`data.archives`)."""

    path: str
    label: int
    loc: object = field(default=None, compare=False)


@dataclass(frozen=True)
class RawName:
    """Where a file lies whose name is not valid UTF-8: its real path below the split folder (with
    surrogate escapes) and the escaped name it is known by (`shown`, as report.json prints it)."""

    path: str
    shown: str

    def display(self) -> str:
        return self.shown


def printable(name: str) -> str:
    """`name` as text: the bytes of a name that is not valid UTF-8 (os's surrogate escapes) as \\xNN."""
    try:
        name.encode()
        return name
    except UnicodeEncodeError:
        try:
            raw = name.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that no file system name decodes to
            return name.encode("utf-8", "backslashreplace").decode()
        return raw.decode("utf-8", "backslashreplace")


@dataclass
class Split:
    """The images of one split, in a defined order, plus the files that were passed over."""

    root: str
    items: list[Item]
    ignored: list[dict] = field(default_factory=list)  # {path, reason}, path as report.json shows it
    outside: int = 0  # images of classes left out by a class subset


@dataclass(frozen=True)
class Entry:
    """One file of a split's source: canonical name, location, and the class its source name gives."""

    name: str
    loc: object = None
    wnid: str | None = None


@dataclass
class Listing:
    """Every file of one split's source; `containers` are class folders or inner tars, even empty ones."""

    root: str
    split: str
    entries: list[Entry]
    containers: list[str] = field(default_factory=list)
    ignored: list[dict] = field(default_factory=list)

    def where(self, entry: Entry) -> str:
        """The entry as report.json names it: 'split/name' for files, 'archive:member' for members."""
        return entry.loc.display() if entry.loc is not None else f"{self.split}/{entry.name}"


def name_problem(name: str) -> str | None:
    """Why a source name ('/'-separated, as listed) cannot become a class or file name; None if it can.

    Absolute names and '..', '.' or empty components would make classes of '..' or '' (shifting every
    label) or name files outside the split; a backslash is another system's separator. Archives holding
    such a member are refused (never the case in ImageNet's own archives); so is a folder file named so.
    """
    if not name:
        return "is empty"
    if name.startswith("/"):
        return "is absolute"
    if "\\" in name:
        return "holds a backslash (another system's path separator)"
    parts = name.split("/")
    if ".." in parts:
        return "has a '..' component"
    if "." in parts or "" in parts:
        return "has a '.' or empty component"
    return None


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTS


def require_dir(path: str | os.PathLike, what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {p} does not exist")
    if not p.is_dir():
        raise DataError(f"{what} {p} is not a directory or an archive (.tar, .tar.gz)")
    return p


def list_folder(folder: str | os.PathLike, split: str, what: str) -> Listing:
    """All files below `folder` as sorted '/'-separated relative names; its subfolders are the containers.

    Links to folders are followed, but a folder reached twice (a class folder linked to the root or to
    another class folder, a link loop) is a DataError naming it: its images would be listed twice. A
    folder that cannot be listed raises its OSError (it would otherwise look empty).
    """
    root = require_dir(folder, what)
    seen = {os.path.realpath(root): f"the {what} itself"}
    entries, containers = [], []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise, followlinks=True):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = _subfolders(root, rel, dirnames, seen, what)
        if rel == Path("."):
            containers = list(dirnames)
        entries.extend(_file_entry((rel / f).as_posix(), split) for f in filenames)
    entries.sort(key=lambda e: e.name)
    _escapes_unique(entries, root)
    for e in entries:
        problem = name_problem(e.loc.path if isinstance(e.loc, RawName) else e.name)
        if problem:
            raise DataError(f"{what} {root}: file {e.name!r} {problem}; rename it")
    listing = Listing(str(root), split, [], containers)
    listing.entries = _one_name_per_file(root, entries, listing)
    return listing


def wrapper(listing: Listing) -> str | None:
    """The one top-level folder every entry of `listing` lies in, two levels down or more, if there is one: a
    tar made the usual way (``tar cf train.tar -C SRC train``: members ``train/<wnid>/<image>``), or the
    folder holding such a ``train/``. Its content is the source: taken as it is, its name would be the one
    class of every image (every label 0: a loss of 0 that teaches nothing)."""
    tops = {e.name.split("/", 1)[0] for e in listing.entries}
    if len(tops) != 1 or listing.containers and listing.containers != sorted(tops):
        return None
    below = [e for e in listing.entries if "/" in e.name]  # a file at the top is no folder around classes
    if len(below) == len(listing.entries) and all(e.wnid is None for e in below) and any(
            e.name.count("/") >= 2 for e in below):
        return tops.pop()
    return None


def unwrapped(listing: Listing, top: str) -> Listing:
    """An archive's `listing` with the folder `top` taken off every name (see :func:`wrapper`)."""
    cut = len(top) + 1
    entries = [Entry(e.name[cut:], e.loc, e.wnid) for e in listing.entries]
    return Listing(listing.root, listing.split, entries, [], listing.ignored)


SPLIT_NAMES = frozenset({"train", "val", "valid", "validation", "test"})


def single_class_problem(listing: Listing, classes: list[str]) -> str | None:
    """Why `classes` (a train source's) look like a layout mistake, not a dataset: one class, or a class named
    like a split (a folder of splits taken for a folder of classes). None if they look like classes."""
    named = sorted(c for c in classes if c.lower() in SPLIT_NAMES)
    if len(classes) == 1 or named:
        which = f"a class named {named[0]!r}, like a split" if named else f"one class, {classes[0]!r}"
        return (f"train dir {listing.root} gives {which}: expected <wnid>/<image> class folders (one folder or "
                "archive level above them); point --train-dir at them, or pass --allow-one-class if this is "
                "meant")
    return None


def _raise(e: OSError) -> None:
    raise e


def _one_name_per_file(root: Path, entries: list[Entry], listing: Listing) -> list[Entry]:
    """Each real file once, as the tar route reads an archive of the same tree: another name of a file
    already listed (a hard link, or a symbolic link into the tree) and anything that is not a regular
    file (a FIFO would hang the decoder) go to `listing.ignored` with the reason. A file's name is its
    first non-link name in name order. One lstat per file (a stat more per symbolic link)."""
    found, base = [], os.path.join(root, "")
    for e in entries:
        ident = _identity(base + (e.loc.path if isinstance(e.loc, RawName) else e.name))
        if isinstance(ident, str):
            listing.ignored.append({"path": listing.where(e), "reason": ident})
        else:
            found.append((e, *ident))
    keep: dict[tuple[int, int], Entry] = {}
    for e, ident, _ in sorted(found, key=lambda f: f[2]):  # stable: names in order, real files first
        keep.setdefault(ident, e)
    kept = []
    for e, ident, link in found:
        if keep[ident] is e:
            kept.append(e)
        else:
            kind = "symbolic" if link else "hard"
            listing.ignored.append({"path": listing.where(e), "reason": f"{kind} link to the same file as "
                                    f"{keep[ident].name}: read once, under that name"})
    return kept


def _identity(path: str) -> tuple[tuple[int, int], bool] | str:
    """((device, inode), is a symbolic link) of the regular file at `path`, else why it is not read."""
    st = os.lstat(path)
    link = stat.S_ISLNK(st.st_mode)
    if link:
        try:
            st = os.stat(path)
        except OSError as e:
            return f"symbolic link to {printable(os.readlink(path))}, which cannot be opened ({e.strerror}): not read"
    if not stat.S_ISREG(st.st_mode):
        kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
        return (f"symbolic link to {printable(os.readlink(path))}, which is not a regular file" if link else
                f"not a regular file ({kind})") + ": not read"
    return (st.st_dev, st.st_ino), link


def _subfolders(root: Path, rel: Path, names: list[str], seen: dict[str, str], what: str) -> list[str]:
    """The subfolders of `root/rel` to walk (sorted, not hidden); each real folder once."""
    kept = []
    for d in sorted(n for n in names if not n.startswith(".")):
        shown = printable((rel / d).as_posix())
        if shown != (rel / d).as_posix():
            raise DataError(f"{what} {root}: folder name {shown} is not valid UTF-8; rename it")
        real = os.path.realpath(root / rel / d)
        if real in seen:
            raise DataError(f"{what} {root}: {shown} is {seen[real]} ({printable(real)}) through a link: its "
                            "images would be listed twice; remove the link")
        top = os.path.realpath(root)
        if top.startswith(real.rstrip(os.sep) + os.sep):
            raise DataError(f"{what} {root}: {shown} leads to {printable(real)}, which holds the {what}: a "
                            "link loop; remove the link")
        seen[real] = f"the same folder as {shown}"
        kept.append(d)
    return kept


def _file_entry(rel: str, split: str) -> Entry:
    name = printable(rel)
    return Entry(name) if name == rel else Entry(name, RawName(rel, f"{split}/{name}"))


def _escapes_unique(entries: list[Entry], root: Path) -> None:
    """An escaped name must not coincide with a real one (a file literally named 'a\\xff.jpg')."""
    if not any(isinstance(e.loc, RawName) for e in entries):
        return
    for a, b in zip(entries, entries[1:]):
        if a.name == b.name:
            raise DataError(f"{root}: two files are both named {a.name} once escaped (one is not valid UTF-8); "
                            "rename one")


def _class_of(entry: Entry) -> str | None:
    if entry.wnid is not None:
        return entry.wnid
    return entry.name.split("/", 1)[0] if "/" in entry.name else None


def find_classes(listing: Listing) -> list[str]:
    """The sorted wnids of a train source: its class folders (or inner tars) and the classes of its images."""
    classes = set(listing.containers) | {c for e in listing.entries if (c := _class_of(e)) is not None}
    if not classes:
        raise DataError(f"train dir {listing.root} has no class folders (expected <wnid>/<image> folders, "
                        "a tar of <wnid>.tar archives, or <stem>_<wnid>.JPEG shards)")
    return sorted(classes)


def class_split(listing: Listing, classes: list[str], chosen: list[str], what: str) -> Split:
    """A split whose images are sorted by class; every class must be one of `classes`, and images of
    classes outside `chosen` (a subset) are left out."""
    known, index = set(classes), {c: i for i, c in enumerate(chosen)}
    unknown = sorted({c for e in listing.entries if (c := _class_of(e)) is not None} - known)
    if unknown:
        raise DataError(f"{what} {listing.root} has class folders not in the train classes: {_examples(unknown)}")
    split = Split(listing.root, [], list(listing.ignored))
    for e in listing.entries:
        c = _class_of(e)
        if c is None:
            split.ignored.append({"path": listing.where(e), "reason": "file outside any class folder"})
        elif not is_image_name(e.name):
            split.ignored.append({"path": listing.where(e), "reason": "not an image file (by extension)"})
        elif c not in index:
            split.outside += 1
        else:
            split.items.append(Item(e.name if e.wnid is None else f"{c}/{e.name}", index[c], e.loc))
    return split


# -- flat validation (labelled by data.val_labels) -------------------------------------------------


@dataclass
class ValLabels:
    """Flat validation labels: file key -> wnid; keys are extension-less stems when `by_stem`."""

    source: str
    labels: dict[str, str]
    by_stem: bool
    names: dict[str, str] | None = None  # wnid -> words, when the labeller gives them
    names_source: str = ""  # where the words come from


def _examples(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def flat_split(listing: Listing, labels: ValLabels, chosen: list[str]) -> Split:
    """A flat split labelled by `labels`; every labelled file must exist and every image be labelled."""
    index = {c: i for i, c in enumerate(chosen)}
    split, unlabelled, seen = Split(listing.root, [], list(listing.ignored)), [], set()
    for e in listing.entries:
        if "/" in e.name:
            split.ignored.append({"path": listing.where(e), "reason": "file in a folder of a flat split"})
            continue
        if not is_image_name(e.name):
            split.ignored.append({"path": listing.where(e), "reason": "not an image file (by extension)"})
            continue
        key = os.path.splitext(e.name)[0] if labels.by_stem else e.name
        if key not in labels.labels:
            unlabelled.append(e.name)
            continue
        seen.add(key)
        if e.wnid is not None and e.wnid != labels.labels[key]:
            raise DataError(f"{listing.where(e)} names class {e.wnid}, but {labels.source} gives "
                            f"{labels.labels[key]}; drop --val-labels to use the names, or check the files")
        if labels.labels[key] in index:
            split.items.append(Item(e.name, index[labels.labels[key]], e.loc))
        else:
            split.outside += 1
    missing = sorted(set(labels.labels) - seen)
    if missing:
        raise DataError(f"label file {labels.source} names {len(missing)} file(s) not found in {listing.root}: "
                        f"{_examples(missing)}")
    if unlabelled:
        raise DataError(f"{len(unlabelled)} image(s) in {listing.root} have no label in {labels.source}: "
                        f"{_examples(unlabelled)}")
    return split


def val_split(listing: Listing, labels: ValLabels | None, classes: list[str], chosen: list[str]) -> Split:
    """Validation: flat with a labeller, labelled by its member names (shards), or class folders."""
    if labels is None and listing.entries and all(e.wnid is not None for e in listing.entries):
        labels = ValLabels(listing.root, {e.name: e.wnid for e in listing.entries}, False)
    if labels is not None:
        unknown = sorted(set(labels.labels.values()) - set(classes))
        if unknown:
            raise DataError(f"{labels.source} names classes not in the train classes: {_examples(unknown)}")
        return flat_split(listing, labels, chosen)
    if not any("/" in e.name for e in listing.entries) and not listing.containers:
        raise DataError(f"val dir {listing.root} has no class folders; for a flat val folder pass --val-labels "
                        "LOC_val_solution.csv (Kaggle), val.txt (Caffe) or the devkit (ILSVRC2012_devkit_t12.tar.gz)")
    return class_split(listing, classes, chosen, "val dir")
