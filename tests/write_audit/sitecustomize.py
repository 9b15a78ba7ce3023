"""Loaded by every Python process of a tool that tests/write_points.py runs (its folder is put first on
PYTHONPATH): with ALEXNET_WRITE_AUDIT naming a file, each file opened for writing, by any process of the
tool's tree and any library that opens through Python (open, os.open, numpy, torch.save, PIL, matplotlib),
is recorded there as "PID PATH". What is not renamed into place by data.fsutil.commit is then seen."""
import os
import sys

_LOG = os.environ.get("ALEXNET_WRITE_AUDIT")
_WRITING = os.O_WRONLY | os.O_RDWR


def _record(event: str, args: tuple) -> None:
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)) or not args[2] & _WRITING:
        return
    os.write(_FD, f"{os.getpid()} {os.path.abspath(os.fsdecode(args[0]))}\n".encode())  # one append: atomic


if _LOG:
    _FD = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)  # before the hook
    sys.addaudithook(_record)
