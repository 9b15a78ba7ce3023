"""ImageNet's archives read in place: member indexes of uncompressed tars, reads by offset, gzip shards streamed.

Uncompressed tars (``ILSVRC2012_img_train.tar``, a tar of 1,000 per-class tars; ``ILSVRC2012_img_val.tar``)
are indexed once: the offset and size of every image, the members of an inner ``.tar`` at the outer
member's offset plus their own. Workers then read each image with one ``os.pread``; nothing is
extracted. Gzip shards (Hugging Face's ``train_images_*.tar.gz``) cannot be read at an offset: they are
listed once (a full decompression) and streamed again whenever images are needed (see :func:`collect`).

The index of every archive is kept in ``<out>/sources_index.json`` with a fingerprint of the archive (size,
mtime, inode, ctime; the headers of its first and last indexed members, or a shard's first and last
64 KiB), so a resumed run does not rescan, and an archive that changed since is noticed and indexed again.
The index is trusted by content too: every member read checks the 512-byte tar header right before its
data against the indexed one, and a shard's stream must yield each member under its indexed name,
offset and size. A truncated, unreadable or changed archive is an :class:`ArchiveError` naming it.

Only regular members are images. Links and other members (devices, FIFOs, sparse files) are returned
with the reason they are not read (report.json's ``ignored``); a hard link to a regular member of the
same tar is the same image: read once, under the first of its names in name order (as the folder route
reads a file with several names), the other names listed.
"""
from __future__ import annotations

import io
import json
import os
import posixpath
import sys
import tarfile
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from .batchfile import atomic_write_bytes
from .layouts import DataError, printable
from .procs import in_threads

INDEX_NAME = "sources_index.json"
INDEX_VERSION = 2  # 2: header checksums, fingerprints, members not read; an older index is made again
INDEX_START = b'{"version":'  # how every index SourceIndex writes begins (compact JSON, "version" first)
SHARD_SUFFIXES = (".tar.gz", ".tgz")
_BLOCK = tarfile.BLOCKSIZE
_STREAM_BUFFER = 1 << 20  # compressed bytes per read while streaming a shard
_EDGE = 1 << 16  # bytes at each end of a gzip shard in its fingerprint
CHANGED = "delete sources_index.json (in --out) or restore the archive"


class ArchiveError(DataError):
    """An archive that is truncated, unreadable, or changed since it was indexed; names it."""


def archive_kind(path: str | os.PathLike) -> str | None:
    """'tar' (read in place), 'shard' (gzip, streamed) or None (not an archive name)."""
    name = str(path).lower()
    if name.endswith(SHARD_SUFFIXES):
        return "shard"
    return "tar" if name.endswith(".tar") else None


@dataclass(frozen=True)
class TarMember:
    """Where an image lies in an uncompressed tar: read with one pread."""

    archive: str  # absolute path
    name: str  # member name; 'outer.tar:inner' inside a nested tar
    offset: int
    size: int
    header: int  # zlib.crc32 of the 512 bytes before the data (the member's tar header) when indexed

    def display(self) -> str:
        return printable(f"{self.archive}:{self.name}")


@dataclass(frozen=True)
class ShardMember:
    """An image in a gzip shard: its bytes come from a streaming pass (:func:`collect`)."""

    archive: str
    name: str
    size: int
    offset: int = -1  # of its data in the decompressed stream, when indexed

    def display(self) -> str:
        return printable(f"{self.archive}:{self.name}")


# -- indexing --------------------------------------------------------------------------------------


class _Window(io.RawIOBase):
    """Bytes [start, start + size) of a file descriptor as a seekable file (pread: no shared position)."""

    def __init__(self, fd: int, start: int, size: int):
        super().__init__()
        self.fd, self.start, self.size, self.pos = fd, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.size - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + pos
        return self.pos

    def tell(self) -> int:
        return self.pos


def _clean(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name


def _tar_members(fd: int, start: int, size: int, where: str) -> list[tarfile.TarInfo]:
    """The members of the tar at [start, start + size) of `fd`; a missing end-of-archive block is an error."""
    window = _Window(fd, start, size)
    with tarfile.open(fileobj=window, mode="r:") as tf:
        members = tf.getmembers()
        end = tf.offset
    # tarfile stops quietly at a header that is cut off; a complete archive ends with zero blocks.
    if os.pread(fd, _BLOCK, start + end) != bytes(_BLOCK) or end + _BLOCK > size:
        raise ArchiveError(f"{where} ends without tar's end-of-archive block after {len(members)} members: "
                           "truncated? (download it again)")
    return members


def _header_crc(fd: int, data_offset: int) -> int:
    """crc32 of the 512-byte block before a member's data: its tar header (what a read checks again)."""
    return zlib.crc32(os.pread(fd, _BLOCK, data_offset - _BLOCK))


def sort_members(members: list[tarfile.TarInfo], where: str, read_links: bool = True
                 ) -> tuple[list[tuple[str, tarfile.TarInfo]], list[list[str]]]:
    """(name, member) of each image to read, in archive order, and [name, reason] of each member not read.

    Directories are structure, not content. A hard link to an earlier regular member is the same image:
    with `read_links`, read once under the first of its names in name order (the folder route's choice),
    else under the regular member's name. Symbolic links, devices, FIFOs and sparse members are never
    read; each is returned with the reason.
    """
    regular: list[tuple[str, tarfile.TarInfo]] = []  # a name twice stays twice: the listing refuses it
    last: dict[str, int] = {}  # name -> its latest regular member, the one a hard link means
    names: list[list[str]] = []  # per regular member: its names (itself and its hard links)
    others, symlinks = [], []
    for ti in members:
        name = _clean(ti.name)
        if ti.isdir():
            continue
        if ti.isreg() and not ti.issparse():
            last[name] = len(regular)
            regular.append((name, ti))
            names.append([name])
        elif ti.islnk() and _clean(ti.linkname) in last:
            names[last[_clean(ti.linkname)]].append(name)
        elif ti.issym():
            symlinks.append((name, ti.linkname))
        else:
            others.append([name, _not_read(ti, where)])
    kept, read_as = [], {}  # read_as: each name of a file -> the name it is read under
    for (name, ti), all_names in zip(regular, names):
        keep = min(all_names) if read_links else name
        kept.append((keep, ti))
        read_as.update((n, keep) for n in all_names)
        others += [[n, f"hard link to the same file as {keep}: read once, under that name"]
                   for n in all_names if n != keep]
    return kept, others + [[name, _symlink_reason(name, link, read_as, where)] for name, link in symlinks]


def _symlink_reason(name: str, link: str, read_as: dict[str, str], where: str) -> str:
    """Why a symbolic link member is not read: its target is read under its own name, or is not held."""
    target = read_as.get(posixpath.normpath(posixpath.join(posixpath.dirname(name), link)))
    if target is not None:
        return f"symbolic link to the same file as {target}: read once, under that name"
    return f"symbolic link to {link}, which {where} does not hold as a file: not read"


def _not_read(ti: tarfile.TarInfo, where: str) -> str:
    """Why a member that is neither a file, a directory, a symbolic link nor a readable hard link is not read."""
    if ti.islnk():
        return f"hard link to {ti.linkname}, which {where} does not hold as a file before it: not read"
    if ti.issparse():
        return "sparse file (its data is not one run of bytes): not read"
    kind = {tarfile.CHRTYPE: "character device", tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "FIFO"}
    return f"not a regular file ({kind.get(ti.type, f'tar type {ti.type!r}')}): not read"


def index_tar(path: str) -> tuple[list[list], list[list]]:
    """(rows, others) of an uncompressed tar: [name, data offset, size, header crc] of every image, inner
    ``.tar`` members expanded (name [outer, inner], offset within the outer file), and [name, reason] of
    every member not read (sort_members)."""
    rows, others = [], []
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ArchiveError(f"cannot open archive {path} ({e.strerror})") from None
    try:
        kept, skipped = sort_members(_tar_members(fd, 0, os.fstat(fd).st_size, path), f"archive {path}")
        others += skipped
        for name, ti in kept:
            if not name.endswith(".tar"):
                rows.append([name, ti.offset_data, ti.size, _header_crc(fd, ti.offset_data)])
                continue
            where = f"{path}:{name}"
            inner_kept, inner_skipped = sort_members(_tar_members(fd, ti.offset_data, ti.size, where), where)
            others += [[[name, n], why] for n, why in inner_skipped]
            for inner, iti in inner_kept:
                offset = ti.offset_data + iti.offset_data
                rows.append([[name, inner], offset, iti.size, _header_crc(fd, offset)])
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArchiveError(f"archive {path} is unreadable or truncated ({e}); download it again") from None
    finally:
        os.close(fd)
    return rows, others


def _open_shard(path: str) -> tarfile.TarFile:
    return tarfile.open(path, mode="r|gz", bufsize=_STREAM_BUFFER)


def _shard_error(path: str, e: BaseException) -> ArchiveError:
    return ArchiveError(f"gzip shard {path} is unreadable or truncated ({type(e).__name__}: {e}); "
                        "download it again")


class Stopped(Exception):
    """A streaming pass given up because the run is stopping (Ctrl-C, or another shard failed)."""


def _members_of(tf: tarfile.TarFile, stop: threading.Event | None):
    for ti in tf:
        if stop is not None and stop.is_set():
            raise Stopped
        yield ti


def index_shard(path: str, stop: threading.Event | None = None) -> tuple[list[list], list[list]]:
    """(rows, others) of a gzip shard (one full pass): [name, offset in the decompressed stream, size] of
    every image, [name, reason] of every member not read (sort_members; a hard link keeps the name of
    the member it links to, whose bytes the stream yields)."""
    try:
        with _open_shard(path) as tf:
            members = list(_members_of(tf, stop))
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise _shard_error(path, e) from None
    kept, others = sort_members(members, f"gzip shard {path}", read_links=False)
    return [[name, ti.offset_data, ti.size] for name, ti in kept], others


def collect(path: str, wanted: dict[str, tuple[int, int]], stop: threading.Event | None = None) -> dict[str, bytes]:
    """One streaming pass over a gzip shard: the bytes of the members named in `wanted` (name -> indexed
    (offset, size)); a member the stream yields at another offset or size is an ArchiveError.

    Stops as soon as all of them are in hand (a window of sorted validation images needs only a prefix).
    """
    found: dict[str, bytes] = {}
    try:
        with _open_shard(path) as tf:
            for ti in _members_of(tf, stop):
                name = _clean(ti.name)
                if name in wanted and ti.isreg() and name not in found:
                    if (ti.offset_data, ti.size) != tuple(wanted[name]):
                        raise ArchiveError(
                            f"gzip shard {path}: member {printable(name)} changed since it was indexed (now "
                            f"{ti.size} bytes at {ti.offset_data} of the stream, indexed {wanted[name][1]} at "
                            f"{wanted[name][0]}): {CHANGED}")
                    found[name] = tf.extractfile(ti).read()
                    if len(found) == len(wanted):
                        break
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise _shard_error(path, e) from None
    if len(found) < len(wanted):
        raise ArchiveError(f"gzip shard {path} no longer holds {len(wanted) - len(found)} member(s) it was "
                           f"indexed with (e.g. {printable(sorted(set(wanted) - set(found))[0])}): it changed since it "
                           f"was indexed; {CHANGED}")
    return found


def with_stop(fn, items: list, threads: int) -> list:
    """[fn(item, stop) for item in items] on up to `threads` threads (zlib releases the GIL, so shards
    decompress side by side; data.procs.in_threads); if anything fails or Ctrl-C comes, `stop` is set so the
    running ones give up at their next member instead of finishing a pass over a whole shard."""
    stop = threading.Event()
    return in_threads(lambda item: fn(item, stop), items, min(threads, len(items)), stop=stop)


# -- the index file --------------------------------------------------------------------------------


def stamp(path: str) -> list[int]:
    """What tells an archive from its replacement without reading it: size, mtime, inode, ctime (a file
    written over another keeps neither its inode nor its ctime, even with the same size and mtime)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ArchiveError(f"cannot read archive {path} ({e.strerror})") from None
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def _edges(path: str) -> list[int]:
    """crc32 of a gzip shard's first and last 64 KiB (its members cannot be read at an offset)."""
    with open(path, "rb") as f:
        head = f.read(_EDGE)
        f.seek(max(0, os.fstat(f.fileno()).st_size - _EDGE))
        return [zlib.crc32(head), zlib.crc32(f.read(_EDGE))]


def _changed(path: str, entry: dict, now: list[int]) -> str | None:
    """Why an indexed archive no longer matches its index (None: it does); cheap, nothing is scanned."""
    if entry.get("stamp") != now:
        return "size, mtime, inode or ctime"
    try:
        if entry["kind"] == "shard":
            return None if entry.get("edges") == _edges(path) else "its first or last 64 KiB"
        rows = entry["members"]
        fd = os.open(path, os.O_RDONLY)
        try:  # the first and last images' headers, where the index says they are
            same = all(_header_crc(fd, row[1]) == row[3] for row in rows[:1] + rows[-1:])
        finally:
            os.close(fd)
        return None if same else "the header of its first or last member"
    except (OSError, KeyError, IndexError, TypeError) as e:
        return f"cannot be checked ({e})"


class SourceIndex:
    """The member lists of the archives of a run, kept in ``<out>/sources_index.json``."""

    def __init__(self, out: str | os.PathLike, quiet: bool = False):
        self.path, self.quiet = Path(out) / INDEX_NAME, quiet
        self.entries: dict[str, dict] = self._saved()

    def _saved(self) -> dict[str, dict]:
        """The entries an earlier run kept; none if there is no index yet, or one this version cannot use (an
        older version, or damaged): every archive is then indexed again and the file replaced."""
        try:
            saved = json.loads(self.path.read_text())
            return saved["archives"] if saved.get("version") == INDEX_VERSION else {}
        except (OSError, ValueError, KeyError, AttributeError):
            return {}

    def members(self, archives: list[str], workers: int = 1) -> dict[str, dict]:
        """archive -> {kind, stamp, members, others[, edges]}; archives not indexed, or changed since (by
        their fingerprint: _changed), are indexed."""
        todo = []
        for path in archives:
            entry, now = self.entries.get(path), stamp(path)
            why = _changed(path, entry, now) if entry is not None else None
            if entry is not None and why is None:
                continue
            if entry is not None:
                print(f"preprocess: {path} changed since it was indexed ({why}); indexing it again", file=sys.stderr)
            todo.append((path, now))
        if todo:
            self._index(todo, workers)
        return {p: self.entries[p] for p in archives}

    def _index(self, todo: list[tuple[str, list[int]]], workers: int) -> None:
        if not self.quiet:
            print(f"preprocess: indexing {len(todo)} archive(s) once (kept in {self.path}): "
                  + ", ".join(Path(p).name for p, _ in todo), file=sys.stderr)

        def one(item: tuple[str, list[int]], stop: threading.Event) -> tuple[str, dict]:
            path, before = item
            kind = archive_kind(path)
            rows, others = index_shard(path, stop) if kind == "shard" else index_tar(path)
            entry = {"kind": kind, "stamp": before, "members": rows, "others": others}
            if kind == "shard":
                entry["edges"] = _edges(path)
            if stamp(path) != before:
                raise ArchiveError(f"archive {path} changed while it was being indexed")
            return path, entry

        self.entries.update(with_stop(one, todo, workers))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # compact: ImageNet's train tar alone has 1.28 M rows (~80 MB this way, 2.5x that indented)
        text = json.dumps({"version": INDEX_VERSION, "archives": self.entries}, separators=(",", ":"))
        atomic_write_bytes(self.path, text.encode())  # begins with INDEX_START: --out knows it by that


# -- reading in the workers ------------------------------------------------------------------------

_fds: dict[str, tuple[int, int, int]] = {}  # archive -> (fd, dev, inode), per process


def _reset_after_fork() -> None:
    for fd, _, _ in _fds.values():
        os.close(fd)  # the child's copy only; it opens its own when it reads
    _fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def read_member(m: TarMember, indexed: tuple[int, ...]) -> bytearray:
    """The bytes of one member, read with the tar header before them in one preadv; ArchiveError if the
    archive's stamp is no longer `indexed`, if it is short, or if that header is not the indexed one."""
    try:
        st = os.stat(m.archive)
    except OSError as e:
        raise ArchiveError(f"cannot read archive {m.archive} ({e.strerror})") from None
    if [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns] != list(indexed):
        raise ArchiveError(f"archive {m.archive} changed since it was indexed (size, mtime, inode or ctime); re-run "
                           "the same command to index it again")
    header, data = bytearray(_BLOCK), bytearray(m.size)
    cached = _fds.get(m.archive)
    try:
        if cached is None or cached[1:] != (st.st_dev, st.st_ino):
            if cached is not None:
                os.close(cached[0])
            _fds[m.archive] = (os.open(m.archive, os.O_RDONLY), st.st_dev, st.st_ino)
        got = os.preadv(_fds[m.archive][0], (header, data), m.offset - _BLOCK)
    except OSError as e:
        raise ArchiveError(f"cannot read {m.display()} ({e.strerror})") from None
    if got != _BLOCK + m.size:
        raise ArchiveError(f"archive {m.archive} is truncated: {m.name} needs bytes up to {m.offset + m.size}")
    if zlib.crc32(header) != m.header:
        raise ArchiveError(f"archive {m.archive}: member {printable(m.name)} changed since it was indexed (the "
                           f"header before its data now holds {_describe(header)}; indexed: {m.size} bytes): {CHANGED}")
    return data


def _describe(header: bytes) -> str:
    """What a 512-byte block holds, as a tar header, for a message."""
    try:
        ti = tarfile.TarInfo.frombuf(bytes(header), "utf-8", "surrogateescape")
    except tarfile.HeaderError as e:
        return f"no tar header ({e})"
    return f"{printable(ti.name)!r}, {ti.size} bytes"
