"""File-system helpers shared by the tools: the one place a written file takes its final name (`commit`),
a directory lock that names its holder, the temporary files of dead processes, and the operating
system's refusals as one line and an exit code.

Exit codes follow the tools' rule: 2 for a bad input or path (read-only, no permission, not a
directory), 1 for a failure of the machine (disk full, I/O error, out of memory).
"""
from __future__ import annotations

import errno
import os
import re
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .layouts import DataError

# The temporary names of atomic writes: .<final name>.<pid>.tmp (checkpoint.save_atomic, batchfile.temp_path).
TEMP_FILE = re.compile(r"^\..+\.(\d+)\.tmp(\.[A-Za-z0-9]+)?$")  # .NAME.<pid>.tmp, or .tmp.png (matplotlib's)
_REASONS = {
    errno.ENOSPC: "disk full (no space left on device)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.EISDIR: "is a directory",
    errno.EIO: "input/output error (a failing disk or network file system?)",
}
_BAD_PATH = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
             errno.ENAMETOOLONG, errno.ELOOP}


# Test hooks of `commit` (tests/test_write_points.py): with WRITE_TRACE set to a file, each write point
# appends "N PID MOMENT PATH" to it (N counts the moments of the whole process tree, in order); the thread
# that reaches moment number PAUSE_AT then waits there (until WRITE_TRACE.go exists), for the test to kill
# the tool right at that moment.
WRITE_TRACE = "ALEXNET_WRITE_TRACE"
_SWEPT: set[str] = set()  # the folders this process's commits have swept of dead writers' temporaries
PAUSE_AT = "ALEXNET_WRITE_PAUSE_AT"


class DirInUse(DataError):
    """Another process holds the directory's lock."""


def os_error_message(e: OSError) -> str:
    """'PATH: reason' for an OSError (the reason in plain words for the common refusals)."""
    own = e.strerror and e.errno is not None and e.strerror != os.strerror(e.errno)  # a message of ours
    reason = (e.strerror if own else _REASONS.get(e.errno)) or e.strerror or str(e)
    return f"{e.filename}: {reason}" if e.filename else reason


def os_error_exit_code(e: OSError) -> int:
    """2 for a bad path (read-only, permissions, missing), 1 for a failure of the machine."""
    return 2 if e.errno in _BAD_PATH else 1


def os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind `e` (itself, or what it was raised from or during), if any.

    torch.save turns a failed write into "RuntimeError: [enforce fail at inline_container.cc] unexpected
    pos", raised while handling the OSError (ENOSPC) of the file's write().
    """
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def temp_path(path: str | os.PathLike, keep_suffix: bool = False) -> Path:
    """A per-process temporary name beside `path` (``.NAME.<pid>.tmp``; with `keep_suffix`,
    ``.STEM.<pid>.tmp.SUFFIX``, for writers that choose the format by the name): never a name the tools
    read, and swept by remove_stale_temps once its writer is dead."""
    path = Path(path)
    if keep_suffix:
        return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def commit(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Give the finished file `tmp` its final name `path`, atomically (a reader sees the old file or the
    new one, never a mix): the one place where the tools' files do, so that every write point can be
    enumerated and interrupted by the tests, before the rename and after it. The temporaries that dead
    writers left beside `path` go first, so no tool leaves behind what a killed run of it wrote."""
    _write_point("before", path)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in _SWEPT:  # once per folder and process: a folder of 10,000 batch files is not listed per file
        remove_stale_temps(folder)  # what a killed writer left here: every tool sweeps where it writes
        _SWEPT.add(folder)
    os.replace(tmp, path)
    _write_point("after", path)


def _write_point(moment: str, path: str | os.PathLike) -> None:
    trace = os.environ.get(WRITE_TRACE)
    if not trace:
        return
    import fcntl
    import time
    with open(trace, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # several processes of one tool write (workers, replicas)
        f.seek(0)
        number = sum(1 for _ in f) + 1
        f.write(f"{number} {os.getpid()} {moment} {path}\n")
        f.flush()
    if os.environ.get(PAUSE_AT) == str(number):
        # This thread waits here (SIGSTOP would stop the process only once another thread, maybe, had
        # done the rename) until the test, having killed the tool, lets it go on as if never held.
        go = Path(f"{trace}.go")
        while not go.exists():
            time.sleep(0.01)


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process of this host (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files (``.NAME.<pid>.tmp``, or with a suffix after it, ``.tmp.png``, for writers
    that need one) in `folder` whose writer is no longer alive.

    Such a file is a write that never finished (kill -9, power loss): never trusted, only wasting
    space (a whole checkpoint each). Files of live processes are kept: they may still be renamed.
    """
    removed = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        m = TEMP_FILE.match(entry.name)
        if m and entry.is_file(follow_symlinks=False) and not pid_alive(int(m.group(1))):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(Path(entry.path))
    return removed


def _holder(path: Path) -> str:
    try:
        pid, host = path.read_text().split()[:2]
        return f"pid {pid} on {host}"
    except (OSError, ValueError):
        return "a process that has not written its name yet"


@contextmanager
def exclusive_dir(folder: str | os.PathLike, what: str) -> Iterator[int]:
    """Hold `folder`/.lock (flock: the OS releases it when the holder dies) while the block runs.

    Yields the lock's file descriptor: a child process that inherits it keeps the lock held (it is
    released when the last holder closes it). DirInUse names the holder (pid and host) if another
    process has it; OSError if the folder cannot be created or written.
    """
    import fcntl
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirInUse(f"{folder} is in use by another {what} ({_holder(path)}; lock {path}); wait for it "
                           "to end, or use another directory") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        except OSError as e:  # a full disk: say which file
            raise OSError(e.errno, e.strerror, str(path)) from None
        yield fd
    finally:
        os.close(fd)


@contextmanager
def waiting_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold the flock of `folder` itself (nothing is written in it) while the block runs, waiting for any
    other holder: one process at a time does what the block does there (e.g. fetch a file into it)."""
    import fcntl
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def is_special(path: str | os.PathLike) -> bool:
    """Whether `path` exists (through its links) as neither a regular file nor a folder: a pipe, which blocks
    its reader until a writer comes, a device or a socket; never read or written as a tool's file."""
    path = Path(path)
    return path.exists() and not (path.is_file() or path.is_dir())


SPECIAL = "not a regular file or folder (a device, pipe or socket)"  # what a refusal of such a path says


def special_entries(folder: str | os.PathLike) -> list[str]:
    """The entries under `folder` (its subfolders walked, hidden ones too; links followed to what they name,
    not into folders) that are special (is_special), relative to it and sorted. A tool's own folder (a run
    directory, an output it resumes or rewrites) holds only files it wrote: it opens them by name, and a
    pipe there would block it for ever."""
    found = []
    for parent, folders, files in os.walk(folder):
        for name in files + folders:
            path = os.path.join(parent, name)
            if is_special(path):
                found.append(os.path.relpath(path, folder))
    return sorted(found)


def special_entries_words(folder: str | os.PathLike, shown: str) -> str | None:
    """The refusal of a tool's own folder `shown` that holds special entries (None if it holds none)."""
    found = special_entries(folder)
    if not found:
        return None
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return f"{shown} holds {found[0]}{more}, {SPECIAL}: a tool's folder holds only files it wrote; remove it"


def check_writable(path: str | os.PathLike) -> None:
    """Raise OSError now if a file cannot be written at `path` later. Nothing is made: a missing folder of
    it is made by the write itself, once the work is done (a run refused meanwhile leaves no folder); the
    nearest folder that exists must take new entries."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    blocker = next((p for p in path.absolute().parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():  # mkdir would say "File exists"
        raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)}: {blocker} is a file", str(path))
    try:  # a file (or the first missing folder) can be made there
        tempfile.TemporaryFile(dir=blocker, prefix=f".{path.name}.probe").close()
    except OSError as e:  # name the file asked for, not the probe
        raise OSError(e.errno, e.strerror, str(path)) from None
