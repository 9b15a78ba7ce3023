"""What a preprocessing run reads: each split's input listed (folder, tar, gzip shards), labelled, subset.

Inputs as downloaded: a folder (``<wnid>/<image>``, or flat validation images with --val-labels), the
official ``ILSVRC2012_img_train.tar`` (a tar of per-class tars) or ``ILSVRC2012_img_val.tar``, or one or
more Hugging Face ``.tar.gz`` shards whose members are named ``<stem>_<wnid>.JPEG``. Archives are indexed
through :class:`data.archives.SourceIndex` (kept with the output) and never extracted.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .archives import ArchiveError, ShardMember, SourceIndex, TarMember, archive_kind
from .classnames import names_for, read_class_names
from .layouts import (
    DataError,
    Entry,
    Item,
    Listing,
    Split,
    class_split,
    find_classes,
    is_image_name,
    list_folder,
    name_problem,
    printable,
    single_class_problem,
    unwrapped,
    val_split,
    wrapper,
)
from .val_labels import read_val_labels

_HF_NAME = re.compile(r"^(?P<stem>.+)_(?P<wnid>n\d+)(?P<ext>\.[A-Za-z]+)$")


@dataclass
class Sources:
    """Everything the plan needs: the classes, the splits' items, class names, subset and archive stamps."""

    all_classes: list[str]
    classes: list[str]
    splits: dict[str, Split]
    class_names: list[str] | None
    subset: dict | None
    stamps: dict[str, tuple[int, ...]]  # archive -> its stamp (size, mtime_ns, inode, ctime_ns) when indexed


def as_paths(spec) -> list[str]:
    """One path or a list of paths, as strings."""
    if spec is None:
        return []
    return [str(p) for p in ([spec] if isinstance(spec, (str, os.PathLike)) else spec)]


def _shown(outer: str, inner: str | None) -> str:
    """A member's name as messages and report.json give it: 'outer.tar:inner' inside an inner tar."""
    return outer if inner is None else f"{outer}:{inner}"


def _checked(archive: str, name: str | list[str]) -> tuple[str, str | None]:
    """(outer, inner or None) of an index row's name, each part safe to become a class or file name;
    else the archive is refused before any work (layouts.name_problem)."""
    outer, inner = (name[0], name[1]) if isinstance(name, list) else (name, None)
    for part in (outer, inner):
        problem = name_problem(part) if part is not None else None
        if problem:
            raise DataError(f"archive {archive}: member {printable(_shown(outer, inner))!r} {problem}: such a name "
                            "is never made a class or file name, so the archive is refused; repack it without that "
                            "member")
    return outer, inner


def _tar_entries(archive: str, rows: list[list]) -> tuple[list[Entry], list[str]]:
    """Entries of an uncompressed tar: an inner '<wnid>.tar' is the class folder of its members."""
    entries, containers = [], set()
    for name, offset, size, header in rows:
        outer, inner = _checked(archive, name)
        loc = TarMember(archive, _shown(outer, inner), offset, size, header)
        if inner is not None:
            wnid = outer.rsplit("/", 1)[-1][:-len(".tar")]
            if printable(wnid) != wnid or not wnid:
                raise DataError(f"{loc.display()}: the class tar's name is not a valid UTF-8 wnid")
            containers.add(wnid)
            entries.append(Entry(printable(f"{wnid}/{inner}"), loc))
        else:
            entries.append(Entry(printable(outer), loc))
    return entries, sorted(containers)


def _not_read(archive: str, others: list[list], ignored: list[dict]) -> None:
    """Members an archive holds but that are not read (links, devices, ...): listed with the reason."""
    for name, reason in others:
        outer, inner = _checked(archive, name)
        ignored.append({"path": printable(f"{archive}:{_shown(outer, inner)}"), "reason": reason})


def _shard_entries(archive: str, rows: list[list], ignored: list[dict]) -> list[Entry]:
    """Entries of a Hugging Face shard: member '<stem>_<wnid>.JPEG' is '<stem>.JPEG' of class wnid."""
    entries = []
    for name, offset, size in rows:
        _checked(archive, name)
        loc = ShardMember(archive, name, size, offset)
        m = _HF_NAME.match(name.rsplit("/", 1)[-1])
        if m is None or not is_image_name(name):
            ignored.append({"path": loc.display(), "reason": "not an image named <stem>_<wnid>.<ext>"})
        else:
            entries.append(Entry(printable(m["stem"] + m["ext"]), loc, m["wnid"]))
    return entries


def list_source(inputs: list[str], split: str, what: str, index: SourceIndex, workers: int,
                stamps: dict[str, tuple[int, ...]]) -> Listing:
    """The canonical listing of one split's input: a folder, or one or more archives of one kind."""
    kinds = {archive_kind(p) for p in inputs}
    if kinds == {None} and len(inputs) == 1:
        listing = list_folder(inputs[0], split, what)
        top = wrapper(listing)  # the folder that holds a train/ of class folders: that train/ is the source
        return listing if top is None else list_folder(os.path.join(inputs[0], top), split, what)
    if None in kinds or len(kinds) > 1:
        raise DataError(f"{what}: give one folder, or archives of one kind (.tar or .tar.gz shards), not "
                        f"{', '.join(inputs)}")
    archives = [os.path.abspath(p) for p in inputs]
    for a in archives:
        if not Path(a).is_file():
            raise ArchiveError(f"{what} {a} does not exist" if not Path(a).exists() else f"{what} {a} is not a file")
    listing = Listing(", ".join(archives), split, [])
    for a, entry in index.members(archives, workers).items():
        stamps[a] = tuple(entry["stamp"])
        _not_read(a, entry["others"], listing.ignored)
        if entry["kind"] == "shard":
            listing.entries += _shard_entries(a, entry["members"], listing.ignored)
        else:
            entries, containers = _tar_entries(a, entry["members"])
            listing.entries += entries
            listing.containers = sorted(set(listing.containers) | set(containers))
    listing.entries.sort(key=lambda e: e.name)
    if (top := wrapper(listing)) is not None:  # one folder around the classes, as a folder's would be
        listing = unwrapped(listing, top)
    _no_duplicates(listing)
    return listing


def _no_duplicates(listing: Listing) -> None:
    names = Counter((e.name, e.wnid) for e in listing.entries)
    twice = [k for k, n in names.items() if n > 1]
    if twice:
        name, wnid = twice[0]
        where = [listing.where(e) for e in listing.entries if (e.name, e.wnid) == (name, wnid)]
        raise DataError(f"{len(twice)} image(s) appear more than once in {listing.root}, e.g. {' and '.join(where)}")


def choose_classes(classes: list[str], spec: str | int | None, seed: int) -> tuple[list[str], dict | None]:
    """--classes N (a seeded choice of N wnids) or FILE (the wnids listed, first word per line)."""
    if spec is None:
        return classes, None
    if str(spec).isdigit():
        n = int(spec)
        if not 1 <= n <= len(classes):
            raise DataError(f"--classes {n}: the train source has {len(classes)} classes")
        chosen = sorted(np.random.default_rng([seed, 1]).choice(classes, n, replace=False).tolist())
        return chosen, {"classes": n, "of": len(classes), "chosen_by": f"seed {seed}"}
    path = Path(str(spec))
    if not path.is_file():
        raise DataError(f"--classes {spec}: neither a number nor a file of wnids")
    listed = _listed_wnids(path)
    unknown = [w for w in listed if w not in set(classes)]
    if not listed or unknown:
        raise DataError(f"--classes {path}: {'lists no wnid' if not listed else 'wnids not in the train classes: '}"
                        f"{', '.join(unknown[:5])}")
    return listed, {"classes": len(listed), "of": len(classes), "chosen_by": f"list {path}"}


def _listed_wnids(path: Path) -> list[str]:
    """The sorted first words of the lines of a --classes FILE; a wnid listed twice is an error."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # -sig: a byte-order mark is no wnid
    except UnicodeDecodeError as e:
        raise DataError(f"--classes {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    first: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.split():
            continue
        wnid = line.split()[0]
        if wnid in first:
            raise DataError(f"--classes {path}:{lineno}: {wnid} is listed twice (lines {first[wnid]} and {lineno})")
        first[wnid] = lineno
    return sorted(first)


def cap_per_class(items: list[Item], k: int | None) -> list[Item]:
    """The first `k` images of each class, in canonical-name order (all when k is None)."""
    if k is None:
        return items
    if k < 1:
        raise DataError(f"--train-per-class must be positive, got {k}")
    seen: Counter = Counter()
    out = []
    for it in items:
        seen[it.label] += 1
        if seen[it.label] <= k:
            out.append(it)
    return out


def gather(train, val, val_labels, class_names, opts, out: Path, workers: int, quiet: bool,
           allow_empty_classes: bool = False, allow_one_class: bool = False) -> Sources:
    """List, label and subset both splits (archives indexed into `out`); every input error raised here.

    A chosen class with no training image is an error unless `allow_empty_classes`; one class, or a class
    named like a split, unless `allow_one_class` (layouts.single_class_problem)."""
    if val_labels and not val:
        raise DataError("--val-labels given without --val-dir")
    index, stamps = SourceIndex(out, quiet), {}
    train_listing = list_source(as_paths(train), "train", "train dir", index, workers, stamps)
    all_classes = find_classes(train_listing)
    if not allow_one_class and (problem := single_class_problem(train_listing, all_classes)):
        raise DataError(problem)
    chosen, subset = choose_classes(all_classes, opts.class_subset, opts.seed)
    splits = {"train": class_split(train_listing, all_classes, chosen, "train dir")}
    if not allow_empty_classes:
        _no_empty_classes(splits["train"], chosen)
    splits["train"].items = cap_per_class(splits["train"].items, opts.train_per_class)
    labels = read_val_labels(as_paths(val_labels), all_classes) if val_labels else None
    if val:
        listing = list_source(as_paths(val), "val", "val dir", index, workers, stamps)
        splits["val"] = val_split(listing, labels, all_classes, chosen)
    for name, split in splits.items():
        if not split.items:
            raise DataError(f"{name} dir {split.root} holds no image files"
                            + (" of the chosen classes" if split.outside else ""))
    if subset is not None:
        subset.update(train_per_class=opts.train_per_class, val_images_outside=splits.get("val", Split("", [])).outside)
    elif opts.train_per_class is not None:
        subset = {"train_per_class": opts.train_per_class}
    words = _class_words(class_names, labels, chosen)
    return Sources(all_classes, chosen, splits, words, subset, stamps)


def _no_empty_classes(split: Split, classes: list[str]) -> None:
    """A class no training image teaches is most likely a folder left empty by mistake."""
    have = {it.label for it in split.items}
    empty = [c for i, c in enumerate(classes) if i not in have]
    if empty:
        more = f" (and {len(empty) - 5} more)" if len(empty) > 5 else ""
        raise DataError(f"train dir {split.root}: {len(empty)} class folder(s) hold no image file: "
                        f"{', '.join(empty[:5])}{more}; remove them, or pass --allow-empty-classes to keep "
                        "them as classes without training images")


def _class_words(class_names, labels, classes: list[str]) -> list[str] | None:
    """--class-names FILE, else the words the val labeller gives (devkit, LOC_synset_mapping.txt), else None."""
    if class_names is not None:
        return names_for(classes, read_class_names(class_names), str(class_names))
    if labels is not None and labels.names is not None:
        return names_for(classes, labels.names, labels.names_source)
    return None
