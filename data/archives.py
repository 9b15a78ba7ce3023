"""ImageNet's archives read in place: member indexes of uncompressed tars, reads by offset, gzip shards streamed.

Uncompressed tars (``ILSVRC2012_img_train.tar``, a tar of 1,000 per-class tars; ``ILSVRC2012_img_val.tar``)
are indexed once: the offset and size of every image, the members of an inner ``.tar`` at the outer
member's offset plus their own. Workers then read each image with one ``os.pread``; nothing is
extracted. Gzip shards (Hugging Face's ``train_images_*.tar.gz``) cannot be read at an offset: they are
listed once (a full decompression) and streamed again whenever images are needed (see :func:`collect`).

The index of every archive is kept in ``<out>/sources_index.json`` with the archive's size and mtime,
so a resumed run does not rescan, and an archive that changed since is noticed and indexed again.
A truncated or unreadable archive is an :class:`ArchiveError` naming it.
"""
from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .batchfile import atomic_write_bytes
from .layouts import DataError, printable

INDEX_NAME = "sources_index.json"
INDEX_VERSION = 1
SHARD_SUFFIXES = (".tar.gz", ".tgz")
_BLOCK = tarfile.BLOCKSIZE
_STREAM_BUFFER = 1 << 20  # compressed bytes per read while streaming a shard


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

    def display(self) -> str:
        return printable(f"{self.archive}:{self.name}")


@dataclass(frozen=True)
class ShardMember:
    """An image in a gzip shard: its bytes come from a streaming pass (:func:`collect`)."""

    archive: str
    name: str
    size: int

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


def index_tar(path: str) -> list[list]:
    """[name, data offset, size] of every regular file of an uncompressed tar; inner ``.tar`` members
    are expanded (name 'outer.tar:inner', offset within the outer file)."""
    rows = []
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ArchiveError(f"cannot open archive {path} ({e.strerror})") from None
    try:
        for ti in _tar_members(fd, 0, os.fstat(fd).st_size, path):
            if not ti.isfile():
                continue
            name = _clean(ti.name)
            if not name.endswith(".tar"):
                rows.append([name, ti.offset_data, ti.size])
                continue
            for inner in _tar_members(fd, ti.offset_data, ti.size, f"{path}:{name}"):
                if inner.isfile():
                    rows.append([f"{name}:{_clean(inner.name)}", ti.offset_data + inner.offset_data, inner.size])
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArchiveError(f"archive {path} is unreadable or truncated ({e}); download it again") from None
    finally:
        os.close(fd)
    return rows


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


def index_shard(path: str, stop: threading.Event | None = None) -> list[list]:
    """[name, offset in the decompressed stream, size] of every regular file of a gzip shard (one full pass)."""
    try:
        with _open_shard(path) as tf:
            return [[_clean(ti.name), ti.offset_data, ti.size] for ti in _members_of(tf, stop) if ti.isfile()]
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise _shard_error(path, e) from None


def collect(path: str, wanted: set[str], stop: threading.Event | None = None) -> dict[str, bytes]:
    """One streaming pass over a gzip shard: the bytes of the members named in `wanted`.

    Stops as soon as all of them are in hand (a window of sorted validation images needs only a prefix).
    """
    found: dict[str, bytes] = {}
    try:
        with _open_shard(path) as tf:
            for ti in _members_of(tf, stop):
                name = _clean(ti.name)
                if name in wanted and ti.isfile():
                    found[name] = tf.extractfile(ti).read()
                    if len(found) == len(wanted):
                        break
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise _shard_error(path, e) from None
    if len(found) < len(wanted):
        raise ArchiveError(f"gzip shard {path} no longer holds {len(wanted) - len(found)} member(s) it was "
                           f"indexed with (e.g. {sorted(wanted - set(found))[0]}); it changed since")
    return found


def in_threads(fn, items: list, threads: int) -> list:
    """[fn(item, stop) for item in items] on up to `threads` threads (zlib releases the GIL, so shards
    decompress side by side); if anything fails or Ctrl-C comes, `stop` is set so the others give up
    at their next member instead of finishing a pass over a whole shard."""
    stop = threading.Event()
    pool = ThreadPoolExecutor(max(1, min(threads, len(items))))
    try:
        futures = [pool.submit(fn, item, stop) for item in items]
        return [f.result() for f in futures]
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True)


# -- the index file --------------------------------------------------------------------------------


def _stamp(path: str) -> list[int]:
    try:
        st = os.stat(path)
    except OSError as e:
        raise ArchiveError(f"cannot read archive {path} ({e.strerror})") from None
    return [st.st_size, st.st_mtime_ns]


class SourceIndex:
    """The member lists of the archives of a run, kept in ``<out>/sources_index.json``."""

    def __init__(self, out: str | os.PathLike, quiet: bool = False):
        self.path, self.quiet = Path(out) / INDEX_NAME, quiet
        self.entries: dict[str, dict] = {}
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("version") == INDEX_VERSION:
                self.entries = saved["archives"]
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # none yet, or unreadable: indexed again

    def members(self, archives: list[str], workers: int = 1) -> dict[str, dict]:
        """archive -> {kind, size, mtime_ns, members}; archives not indexed, or changed since, are indexed."""
        todo = []
        for path in archives:
            entry, stamp = self.entries.get(path), _stamp(path)
            if entry is not None and [entry["size"], entry["mtime_ns"]] == stamp:
                continue
            if entry is not None:
                print(f"preprocess: {path} changed since it was indexed (size or mtime); indexing it again",
                      file=sys.stderr)
            todo.append((path, stamp))
        if todo:
            self._index(todo, workers)
        return {p: self.entries[p] for p in archives}

    def _index(self, todo: list[tuple[str, list[int]]], workers: int) -> None:
        if not self.quiet:
            print(f"preprocess: indexing {len(todo)} archive(s) once (kept in {self.path}): "
                  + ", ".join(Path(p).name for p, _ in todo), file=sys.stderr)

        def one(item: tuple[str, list[int]], stop: threading.Event) -> tuple[str, dict]:
            path, stamp = item
            kind = archive_kind(path)
            rows = index_shard(path, stop) if kind == "shard" else index_tar(path)
            if _stamp(path) != stamp:
                raise ArchiveError(f"archive {path} changed while it was being indexed")
            return path, {"kind": kind, "size": stamp[0], "mtime_ns": stamp[1], "members": rows}

        self.entries.update(in_threads(one, todo, workers))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # compact: ImageNet's train tar alone has 1.28 M rows (~60 MB this way, 2.5x that indented)
        text = json.dumps({"version": INDEX_VERSION, "archives": self.entries}, separators=(",", ":"))
        atomic_write_bytes(self.path, text.encode())


# -- reading in the workers ------------------------------------------------------------------------

_fds: dict[str, tuple[int, int, int]] = {}  # archive -> (fd, dev, inode), per process


def _reset_after_fork() -> None:
    for fd, _, _ in _fds.values():
        os.close(fd)  # the child's copy only; it opens its own when it reads
    _fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def read_member(m: TarMember, stamp: tuple[int, int]) -> bytes:
    """The bytes of one member; ArchiveError if the archive changed since `stamp` (size, mtime) or is short."""
    try:
        st = os.stat(m.archive)
    except OSError as e:
        raise ArchiveError(f"cannot read archive {m.archive} ({e.strerror})") from None
    if (st.st_size, st.st_mtime_ns) != tuple(stamp):
        raise ArchiveError(f"archive {m.archive} changed since it was indexed (size or mtime); re-run the same "
                           "command to index it again (finished batch files are kept)")
    cached = _fds.get(m.archive)
    try:
        if cached is None or cached[1:] != (st.st_dev, st.st_ino):
            if cached is not None:
                os.close(cached[0])
            _fds[m.archive] = (os.open(m.archive, os.O_RDONLY), st.st_dev, st.st_ino)
        data = os.pread(_fds[m.archive][0], m.size, m.offset)
    except OSError as e:
        raise ArchiveError(f"cannot read {m.display()} ({e.strerror})") from None
    if len(data) != m.size:
        raise ArchiveError(f"archive {m.archive} is truncated: {m.name} needs bytes up to {m.offset + m.size}")
    return data
