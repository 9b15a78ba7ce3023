"""Published weights by name: fetched once from their authors' URL into torch's hub cache, checked, reused.

    python scripts/evaluate.py --data imagenet256_tv --weights torchvision

Every tool that takes ``--weights`` (evaluate, predict, figures, convert_weights' source) accepts a name of
PUBLISHED where it takes a path: a path that exists wins; a name is looked up in ``$TORCH_HOME/hub/
checkpoints`` (``~/.cache/torch/hub/checkpoints``: where torchvision keeps ``alexnet-owt-7be5be79.pth``, so
a file it fetched is reused), else downloaded there: into ``FILE.partial`` (resumed where a download
stopped), with a progress bar, checked against the digest its authors published, then renamed into place.
A file whose digest differs is never used: one line names the URL, the expected digest and where to put
the file by hand (offline machines, too). ``ALEXNET_WEIGHTS_MIRROR=URL`` fetches ``URL/FILE`` instead of
the authors' URL (a cluster's own mirror); the digest is checked all the same.

The digests are those the authors publish: torchvision names its files by the first 8 hex digits of their
SHA-256 and checks that prefix (``check_hash``); BVLC's model readmes give each caffemodel's SHA-1. Mean
images by name (``--mean ilsvrc_2012_mean``: MEANS) come the same way.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from data.domains import InputPath
from data.fsutil import SPECIAL, commit, is_special, waiting_lock

from .common import FormatError

CHUNK = 1 << 20
MIRROR_ENV = "ALEXNET_WEIGHTS_MIRROR"


@dataclass(frozen=True)
class Published:
    """A weight set by name: its file, where its authors serve it, and the digest they published."""

    file: str
    url: str
    digest: str  # "sha256:HEX" or "sha1:HEX"; HEX may be a prefix of the full digest, as torchvision's
    about: str

    @property
    def algorithm(self) -> str:
        return self.digest.split(":", 1)[0]

    @property
    def expected(self) -> str:
        return self.digest.split(":", 1)[1]


PUBLISHED: dict[str, Published] = {
    "torchvision": Published(
        "alexnet-owt-7be5be79.pth", "https://download.pytorch.org/models/alexnet-owt-7be5be79.pth",
        "sha256:7be5be79", "torchvision's IMAGENET1K_V1 (arch owt; evaluate on --resize torchvision data)"),
    "bvlc_alexnet": Published(
        "bvlc_alexnet.caffemodel", "http://dl.caffe.berkeleyvision.org/bvlc_alexnet.caffemodel",
        "sha1:9116a64c0fbe4459d18f4bb6b56d647b63920377",
        "BVLC's AlexNet (arch alexnet; --resize caffe data, --mean ilsvrc_2012_mean)"),
    "bvlc_reference_caffenet": Published(
        "bvlc_reference_caffenet.caffemodel",
        "http://dl.caffe.berkeleyvision.org/bvlc_reference_caffenet.caffemodel",
        "sha1:4c8d77deb20ea792f84eb5e6d0a11ca0a8660a46",
        "BVLC's CaffeNet (arch caffenet; --resize caffe data, --mean ilsvrc_2012_mean)"),
}


# Mean images by name (--mean of evaluate, predict, figures), fetched and checked like the weights. BVLC's
# mean is served by no URL of its own with a digest; Caffe's repository holds it as an .npy, the
# binaryproto's mean in its dimensions (commit 47ec9ace, "make python wrapper mean match binaryproto
# dimensions", unchanged since; git blob 666082c6): pinned at a commit, checked by that file's SHA-256.
MEANS: dict[str, Published] = {
    "ilsvrc_2012_mean": Published(
        "ilsvrc_2012_mean.npy",
        "https://raw.githubusercontent.com/BVLC/caffe/9b891540183ddc834a02b2bd81b31afae71b2153/"
        "python/caffe/imagenet/ilsvrc_2012_mean.npy",
        "sha256:97eefba7e046ee097121ad18564329636d2f9c153b748c7313653cae8594a149",
        "BVLC's ILSVRC 2012 mean image (256x256, BGR; imagenet_mean.binaryproto's mean): the --mean of "
        "bvlc_alexnet and bvlc_reference_caffenet"),
}
assert not PUBLISHED.keys() & MEANS.keys()

# The end of every --weights help: what a name fetches.
NAME_HELP = (f"; or a published set by name, fetched once into torch's hub cache and checked: {', '.join(PUBLISHED)}"
             f" (docs/evaluation.md)")
# The argparse type of every argument that reads weights: an existing file or folder, or one of these names.
WEIGHTS = InputPath("either", names=tuple(PUBLISHED), names_are="a published weight set")
# ... and of every --mean: a mean image file, or a name of MEANS.
MEAN_FILE = InputPath("file", names=tuple(MEANS), names_are="a published mean image")
MEAN_HELP = f"; or a published mean by name, fetched once into torch's hub cache and checked: {', '.join(MEANS)}"


class DownloadError(OSError):
    """A published file that could not be fetched (offline, refused, stalled, cut short): one line with the
    URL and where to put the file by hand. An OSError: the machine's failure, not bad input (exit 1)."""


def cache_dir() -> Path:
    """torch.hub's checkpoint folder (``$TORCH_HOME/hub/checkpoints``), as torchvision uses it."""
    import torch.hub
    return Path(torch.hub.get_dir()) / "checkpoints"


def names() -> str:
    return ", ".join(PUBLISHED)


def resolve(value: str | os.PathLike, progress: bool = True, timeout: float = 30.0) -> Path:
    """The path of `value`: itself where it exists (a file or folder), else the cached or freshly fetched file
    of the weight set it names. A bare word that is neither is refused naming the published sets."""
    path = Path(value)
    if is_special(path):  # a pipe would block the reader for ever
        raise FormatError(f"{value}: {SPECIAL}")
    if path.exists() or str(value) not in PUBLISHED:
        if not path.exists() and os.sep not in str(value) and "." not in str(value):
            raise FormatError(f"{value}: no such file or folder, and not a published weight set ({names()})")
        return path
    return fetch(str(value), progress, timeout)


def to_fetch(value: str | os.PathLike) -> tuple[str, Path] | None:
    """(URL, destination) of what resolve(`value`) would download; None where it would not (a path that
    exists, a set already cached, or not a name at all)."""
    if Path(value).exists() or str(value) not in PUBLISHED:
        return None
    entry = PUBLISHED[str(value)]
    dest = cache_dir() / entry.file
    return None if dest.is_file() else (url_of(entry), dest)


def fetch(name: str, progress: bool = True, timeout: float = 30.0) -> Path:
    """The checked file of PUBLISHED[name] (or MEANS[name]) in cache_dir(), downloaded (or resumed) if not
    there yet."""
    entry = PUBLISHED[name] if name in PUBLISHED else MEANS[name]
    dest = cache_dir() / entry.file
    dest.parent.mkdir(parents=True, exist_ok=True)
    # One process at a time (replicas, two tools at once): the others wait, then find the file fetched.
    with waiting_lock(dest.parent):
        if dest.is_file():
            _check(dest, entry, url_of(entry), cached=True)
            return dest
        partial = dest.with_name(dest.name + ".partial")
        url = url_of(entry)
        _download(url, partial, entry, dest, progress, timeout)
        try:
            _check(partial, entry, url, cached=False)
        except FormatError:
            partial.unlink(missing_ok=True)  # resuming cannot mend it: the next try starts again
            raise
        commit(partial, dest)
    return dest


def url_of(entry: Published) -> str:
    """Where `entry` is fetched from: its authors' URL, or the mirror's."""
    mirror = os.environ.get(MIRROR_ENV, "").strip()
    return f"{mirror.rstrip('/')}/{entry.file}" if mirror else entry.url


def _by_hand(url: str, entry: Published, dest: Path) -> str:
    return f"download {url} (its {entry.algorithm} starts {entry.expected}) to {dest} by hand, or try again"


def _download(url: str, partial: Path, entry: Published, dest: Path, progress: bool, timeout: float) -> None:
    """`url` into `partial`, from where an earlier download stopped when the server takes a range."""
    have = partial.stat().st_size if partial.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if have and response.status != 206:  # the range was not honoured: the whole file comes
                have = 0
            length = response.headers.get("Content-Length")
            total = have + int(length) if length is not None else None
            with open(partial, "ab" if have else "wb") as out, _bar(total, have, entry.file, progress) as bar:
                while chunk := response.read(CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # asked for a range past the end: the partial file is complete
            return
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}; {_by_hand(url, entry, dest)}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        kept = (f"the part fetched is kept in {partial} and resumed next time; "
                if partial.is_file() and partial.stat().st_size else "")  # refused or offline: nothing came
        raise DownloadError(f"{url}: {reason}; {kept}{_by_hand(url, entry, dest)}") from None
    got = partial.stat().st_size
    if total is not None and got < total:
        raise DownloadError(f"{url}: the connection closed after {got} of {total} bytes; the part fetched is "
                            f"kept in {partial} and resumed next time; {_by_hand(url, entry, dest)}")


def _bar(total: int | None, initial: int, name: str, progress: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc=name,
                file=sys.stderr, dynamic_ncols=True, disable=not progress)


def digest_of(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check(path: Path, entry: Published, url: str, cached: bool) -> None:
    got = digest_of(path, entry.algorithm)
    if not got.startswith(entry.expected):
        where = f"{path} (in the cache: delete it to fetch it again)" if cached else url
        raise FormatError(f"{where}: {entry.algorithm} {got} does not start with the published "
                          f"{entry.expected}: not the file its authors published (damaged or replaced); "
                          f"{_by_hand(url, entry, path if cached else path.with_name(entry.file))}")
