"""alexnet/weights/hub.py: published weights by name, fetched from a local HTTP server on 127.0.0.1 that serves
generated files the way a real server fails (a good file, one cut short, a wrong one, a 404, a stalled
connection), checked against their digest, cached in $TORCH_HOME, resumed, never used when wrong."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from alexnet.models import build_model
from alexnet.weights import hub
from alexnet.weights.common import FormatError
from tests.conftest import load_script
from tests.weights_server import STALL_S


def _cached(entry: hub.Published) -> Path:
    return hub.cache_dir() / entry.file


def test_the_cache_is_torch_homes_hub_checkpoints_as_torchvisions(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    assert hub.cache_dir() == tmp_path / "hub" / "checkpoints"


def test_the_registry_names_each_file_as_its_url_and_torchvisions_digest_as_its_file_name():
    """torchvision names a file by the first 8 hex digits of its SHA-256 (and checks them); BVLC's
    readmes give full SHA-1s: 40 hex digits."""
    for name, entry in hub.PUBLISHED.items():
        assert entry.url.rsplit("/", 1)[1] == entry.file, name
        algorithm, hexdigest = entry.digest.split(":")
        assert algorithm in ("sha256", "sha1") and int(hexdigest, 16) >= 0, name
    tv = hub.PUBLISHED["torchvision"]
    assert tv.digest == "sha256:" + tv.file.removesuffix(".pth").rsplit("-", 1)[1]
    assert all(len(hub.PUBLISHED[n].expected) == 40 for n in ("bvlc_alexnet", "bvlc_reference_caffenet"))


def test_a_good_file_is_fetched_checked_cached_and_then_reused_offline(server, published):
    url, files = server
    files.files["tiny-file.bin"] = body = bytes(range(256)) * 4000  # ~1 MiB: more than one chunk
    entry = published("tiny", body, f"{url}/good")
    path = hub.resolve("tiny", progress=False, timeout=STALL_S * 2)
    assert path == _cached(entry) and path.read_bytes() == body
    assert not list(path.parent.glob("*.partial"))
    files.files.clear()  # the server has nothing now: the cached file is used without asking it
    assert hub.resolve("tiny", progress=False) == path and len(files.log) == 1


def test_a_path_that_exists_wins_over_a_name_and_a_bare_unknown_word_is_refused(tmp_path, monkeypatch, published):
    monkeypatch.chdir(tmp_path)
    Path("torchvision").write_bytes(b"mine")
    assert hub.resolve("torchvision") == Path("torchvision")
    with pytest.raises(FormatError, match=r"torchvisoin: no such file or folder, and not a published weight "
                                          r"set \(torchvision, bvlc_alexnet, bvlc_reference_caffenet"):
        hub.resolve("torchvisoin")
    assert hub.resolve("missing.pt") == Path("missing.pt")  # a file name: the format's own error names it
    assert hub.resolve("runs/none") == Path("runs/none")  # a path, even without a suffix


def test_a_file_cut_short_is_kept_as_partial_and_resumed_from_where_it_stopped(server, published, monkeypatch):
    url, files = server
    files.files["tiny-file.bin"] = body = bytes(range(256)) * 4000
    entry = published("tiny", body, f"{url}/short")
    with pytest.raises(hub.DownloadError, match=rf"{url}/short/tiny-file.bin: .*{len(body) // 2} of {len(body)} "
                                                r"bytes.*kept in .*tiny-file.bin.partial.*resumed next time"):
        hub.resolve("tiny", progress=False)
    partial = _cached(entry).with_name(entry.file + ".partial")
    assert partial.read_bytes() == body[:len(body) // 2] and not _cached(entry).exists()
    monkeypatch.setenv(hub.MIRROR_ENV, f"{url}/good")  # the same file from a mirror that takes ranges
    assert hub.resolve("tiny", progress=False).read_bytes() == body
    assert files.log[-1] == ("/good/tiny-file.bin", f"bytes={len(body) // 2}-")
    assert not partial.exists()


def test_a_wrong_file_is_refused_in_one_line_with_the_url_and_digest_and_never_used(server, published):
    url, files = server
    files.files["tiny-file.bin"] = body = b"weights" * 1000
    entry = published("tiny", body, f"{url}/wrong", algorithm="sha1")
    with pytest.raises(FormatError) as e:
        hub.resolve("tiny", progress=False)
    message = str(e.value)
    assert "\n" not in message and f"{url}/wrong/tiny-file.bin" in message and entry.expected in message
    assert str(_cached(entry)) in message  # where to put it by hand
    assert not _cached(entry).parent.exists() or not any(_cached(entry).parent.iterdir())


def test_a_damaged_cached_file_is_refused_naming_it(server, published):
    url, files = server
    files.files["tiny-file.bin"] = body = b"weights" * 1000
    entry = published("tiny", body, f"{url}/good")
    hub.resolve("tiny", progress=False)
    with open(_cached(entry), "r+b") as f:
        f.write(b"X")
    with pytest.raises(FormatError, match=rf"{_cached(entry)} \(in the cache: delete it to fetch it again\).* "
                                          rf"download {url}/good/tiny-file.bin \(its sha256"):
        hub.resolve("tiny", progress=False)


@pytest.mark.parametrize("route, reason", [("missing", "HTTP 404"), ("stall", "timed out")])
def test_a_404_or_a_stalled_server_is_one_line_with_the_url_and_where_to_put_the_file(server, published, route,
                                                                                        reason):
    url, files = server
    files.files["tiny-file.bin"] = body = bytes(1000)
    entry = published("tiny", body, f"{url}/{route}")
    started = time.monotonic()
    with pytest.raises(hub.DownloadError) as e:
        hub.resolve("tiny", progress=False, timeout=STALL_S)
    assert time.monotonic() - started < STALL_S * 3  # gave up at the timeout, not when the server did
    message = str(e.value)
    assert "\n" not in message and reason in message and f"{url}/{route}/tiny-file.bin" in message
    assert f"to {_cached(entry)} by hand" in message
    assert not _cached(entry).exists()


def test_offline_is_one_line_exit_1_from_the_script(tmp_path, published, capsys):
    """Nothing listens on the port: what an offline machine sees."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    published("torchvision", b"x", f"http://127.0.0.1:{port}")
    data = tmp_path / "data"
    data.mkdir()  # the fetch comes first: an empty folder is never read
    code = load_script("evaluate").main(["--data", str(data), "--weights", "torchvision"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and err.startswith("evaluate.py: error: http://127.0.0.1:")
    assert "by hand" in err


@pytest.mark.processes  # preprocess's worker
def test_evaluate_fetches_checks_caches_and_evaluates_torchvision_by_name(server, published, synth,
                                                                         tmp_path_factory, tmp_path, capsys):
    """`evaluate.py --data D --weights torchvision` against the local server: the same numbers as the file
    given by its path; the second run reads the cache only."""
    from data.preprocess import Options, preprocess
    root, _ = synth
    data = tmp_path_factory.mktemp("prep224")
    preprocess(root / "train", data, root / "val", root / "LOC_val_solution.csv",
               Options(size=224, per_file=64, train_per_class=1), workers=1, quiet=True)
    model = build_model("owt", num_classes=4, width=0.125, crop=224, init="torch")
    tv = tmp_path / "tv.pth"
    torch.save(model.state_dict(), tv)
    url, files = server
    files.files["torchvision-file.bin"] = tv.read_bytes()
    published("torchvision", tv.read_bytes(), f"{url}/good")
    evaluate = load_script("evaluate").main
    by_path, by_name, again = (tmp_path / f"{n}.json" for n in ("path", "name", "again"))
    assert evaluate(["--data", str(data), "--weights", str(tv), "--json", str(by_path)]) == 0
    assert evaluate(["--data", str(data), "--weights", "torchvision", "--json", str(by_name)]) == 0
    assert len(files.log) == 1
    files.files.clear()
    assert evaluate(["--data", str(data), "--weights", "torchvision", "--json", str(again)]) == 0
    results = [json.loads(p.read_text()) for p in (by_path, by_name, again)]
    assert results[0]["n"] == 16
    for r in results[1:]:
        assert (r["top1_err"], r["top5_err"], r["n"]) == (results[0]["top1_err"], results[0]["top5_err"], 16)


def test_a_partial_file_is_resumed_or_restarted_as_the_server_answers(server, published, monkeypatch):
    """A server that ignores the range sends the whole file again: the partial part is not kept in front of
    it. A partial file that is already whole gets 416 for the range past its end: it is checked and used. A
    404 with a partial file is a failure, not a finished download."""
    url, files = server
    files.files["tiny-file.bin"] = body = bytes(range(256)) * 40
    entry = published("tiny", body, "http://127.0.0.1:9")  # the authors' host: never asked (the mirror is)
    partial = hub.cache_dir() / (entry.file + ".partial")
    partial.parent.mkdir(parents=True)
    for route, before in (("whole", body[:100]), ("good", body)):
        partial.write_bytes(before)
        monkeypatch.setenv(hub.MIRROR_ENV, f"{url}/{route}")
        assert hub.resolve("tiny", progress=False).read_bytes() == body, route
        hub.cache_dir().joinpath(entry.file).unlink()
    partial.write_bytes(body[:100])
    monkeypatch.setenv(hub.MIRROR_ENV, f"{url}/missing")
    with pytest.raises(hub.DownloadError, match="HTTP 404"):
        hub.resolve("tiny", progress=False)


def test_a_body_without_a_length_is_read_to_its_end(server, published, monkeypatch):
    url, files = server
    files.files["tiny-file.bin"] = body = b"no length" * 500
    published("tiny", body, "http://127.0.0.1:9")
    monkeypatch.setenv(hub.MIRROR_ENV, f"{url}/unsized/")  # a trailing slash: one, not two, in the URL
    assert hub.resolve("tiny", progress=False).read_bytes() == body
    assert files.log[-1][0] == "/unsized/tiny-file.bin"


def test_the_messages_name_the_url_asked_and_where_the_file_goes_by_hand(server, published, monkeypatch):
    """From a mirror, a failure names the URL asked (the mirror's), first and as the one to fetch by hand, to
    the cache's path (the file's name, not its .partial); offline, the reason is the system's words."""
    url, files = server
    files.files["tiny-file.bin"] = body = bytes(range(256)) * 40
    entry = published("tiny", body, "http://authors.invalid")
    dest = hub.cache_dir() / entry.file
    for route, error in (("wrong", FormatError), ("short", hub.DownloadError), ("missing", hub.DownloadError)):
        monkeypatch.setenv(hub.MIRROR_ENV, f"{url}/{route}")
        with pytest.raises(error) as e:
            hub.resolve("tiny", progress=False)
        message = str(e.value)
        assert message.startswith(f"{url}/{route}/tiny-file.bin: "), (route, message)
        assert f"download {url}/{route}/tiny-file.bin (its sha256 starts {entry.expected}) to {dest} by hand" \
            in message, route
        (dest.parent / (entry.file + ".partial")).unlink(missing_ok=True)
    monkeypatch.setenv(hub.MIRROR_ENV, "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(hub.DownloadError) as e:
        hub.resolve("tiny", progress=False)
    assert "Connection refused" in str(e.value) and "<urlopen error" not in str(e.value)
    assert "download http://127.0.0.1:9/tiny-file.bin (its sha256" in str(e.value)
    assert "kept in" not in str(e.value)  # nothing came, so nothing is kept to resume
    assert re.match(r"http://127\.0\.0\.1:9/tiny-file\.bin: [^;]*Connection refused; download http", str(e.value))
    partial = dest.parent / (entry.file + ".partial")
    partial.write_bytes(body[:100])  # an earlier try's part: kept, and said so
    with pytest.raises(hub.DownloadError) as e:
        hub.resolve("tiny", progress=False)
    assert f"Connection refused; the part fetched is kept in {partial} and resumed next time; download " \
        in str(e.value)
    assert partial.read_bytes() == body[:100]


def test_the_progress_bar_shows_the_file_and_its_size_on_stderr_only_when_asked(server, published, capsys):
    url, files = server
    files.files["tiny-file.bin"] = body = bytes(3 * 1024 * 1024)
    published("tiny", body, f"{url}/good")
    hub.resolve("tiny")  # the default: a bar
    err = capsys.readouterr().err
    assert "tiny-file.bin" in err and "3.00M/3.00M" in err and "100%" in err, err
    hub.cache_dir().joinpath("tiny-file.bin").unlink()
    hub.resolve("tiny", progress=False)
    assert capsys.readouterr().err == ""


def test_two_processes_asking_at_once_fetch_the_file_once(server, published):
    """Replicas of a run (or two tools) that ask for one set together: one downloads, the other waits and
    finds the file; threads here, each with its own lock (flock holds per open file, as across processes)."""
    import threading
    url, files = server
    files.files["tiny-file.bin"] = body = bytes(range(256)) * 4000
    published("tiny", body, f"{url}/slow")
    got, errors, together = [], [], threading.Barrier(2)

    def ask():
        together.wait()  # both ask at once; with one lock or none, the outcome below does not hang on timing
        try:
            got.append(hub.fetch("tiny", progress=False, timeout=STALL_S * 4))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(got) == 2 and got[0] == got[1] and got[0].read_bytes() == body
    assert len(files.log) == 1


def test_a_file_put_in_the_cache_while_waiting_for_the_lock_is_checked_too(server, published, monkeypatch):
    """The other holder of the lock fetched and checked its file; a file that appears there otherwise (by
    hand, damaged) is checked all the same, as a cached file is: refused naming it."""
    import threading
    from contextlib import contextmanager
    url, files = server
    files.files["tiny-file.bin"] = body = b"weights" * 1000
    entry = published("tiny", body, f"{url}/good")
    dest = hub.cache_dir() / entry.file
    dest.parent.mkdir(parents=True)
    real, waiting, errors = hub.waiting_lock, threading.Event(), []

    @contextmanager
    def spied(folder):
        waiting.set()  # past the first look at the cache: the next look is the one under the lock
        with real(folder):
            yield
    monkeypatch.setattr(hub, "waiting_lock", spied)

    def ask():
        try:
            hub.fetch("tiny", progress=False)
        except Exception as e:  # noqa: BLE001 (any failure is the test's answer, below)
            errors.append(e)
        finally:
            waiting.set()  # a fetch that fails before the lock must not leave the test waiting
    with real(dest.parent):
        t = threading.Thread(target=ask)
        t.start()
        waiting.wait()
        dest.write_bytes(b"damaged" * 1000)
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], FormatError), errors
    message = str(errors[0])
    assert message.startswith(f"{dest} (in the cache: delete it to fetch it again): sha256")
    assert f"download {url}/good/tiny-file.bin" in message and files.log == []


def test_to_fetch_names_what_resolve_would_download_and_nothing_else(tmp_path, monkeypatch, published):
    monkeypatch.chdir(tmp_path)
    entry = published("tiny", b"x", "http://127.0.0.1:9")
    dest = hub.cache_dir() / entry.file
    assert hub.to_fetch("tiny") == ("http://127.0.0.1:9/tiny-file.bin", dest)
    assert hub.to_fetch("nothing") is None and hub.to_fetch(tmp_path / "gone.pt") is None
    Path("tiny").write_bytes(b"mine")  # a path that exists wins over the name, as in resolve
    assert hub.to_fetch("tiny") is None
    Path("tiny").unlink()
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"x")
    assert hub.to_fetch("tiny") is None  # cached (resolve checks its digest, and fetches nothing)


# -- mean images by name (--mean ilsvrc_2012_mean) -------------------------------------------------------------

def test_the_published_means_are_pinned_at_a_commit_by_a_full_sha256():
    """A branch's file may change: the URL names a commit (40 hex digits) and the whole SHA-256 is checked."""
    assert hub.MEANS and not hub.MEANS.keys() & hub.PUBLISHED.keys()
    for name, entry in hub.MEANS.items():
        assert entry.url.rsplit("/", 1)[1] == entry.file, name
        commit = entry.url.split("/BVLC/caffe/", 1)[1].split("/", 1)[0]
        assert len(commit) == 40 and int(commit, 16) >= 0, entry.url
        assert entry.algorithm == "sha256" and len(entry.expected) == 64 and int(entry.expected, 16) >= 0, name


def test_a_mean_by_name_is_fetched_once_and_read_as_caffe_bgr_planes(server, published, tmp_path):
    """Caffe's ilsvrc_2012_mean.npy holds BGR planes (3, S, S) in float64: served by name, it gives the same
    RGB image as the same planes written as a .binaryproto, and pixel (i, j) is (R, G, B) by hand."""
    import io

    import numpy as np

    from alexnet.weights.mean_image import read_mean_image
    from tests.caffe_nets import blob
    rng = np.random.default_rng(3)
    bgr = rng.uniform(90, 135, size=(3, 8, 8))  # float64, as Caffe's file
    buf = io.BytesIO()
    np.save(buf, bgr)
    url, files = server
    files.files["tinymean-file.bin"] = buf.getvalue()
    published("tinymean", buf.getvalue(), f"{url}/good", table="MEANS")
    proto = tmp_path / "mean.binaryproto"
    proto.write_bytes(blob(bgr.astype(np.float32)[None], legacy=True))
    got = read_mean_image("tinymean", 8, progress=False)
    assert got.shape == (8, 8, 3) and got.dtype == np.float32
    np.testing.assert_array_equal(got, read_mean_image(proto, 8))
    assert tuple(got[2, 5]) == tuple(np.float32(bgr[c, 2, 5]) for c in (2, 1, 0))
    files.files.clear()  # cached: not asked again
    np.testing.assert_array_equal(read_mean_image("tinymean", 8, progress=False), got)
    assert len(files.log) == 1
    with pytest.raises(FormatError, match=r"tinymean-file\.bin: Caffe's mean image of shape \(3, 8, 8\), not "
                                          r"\(3, 6, 6\) as the 6x6 images"):
        read_mean_image("tinymean", 6)


def test_a_wrong_mean_is_refused_and_a_misspelt_name_names_the_published_means(server, published, tmp_path,
                                                                               monkeypatch, capsys):
    from alexnet.weights.mean_image import read_mean_image
    url, files = server
    files.files["tinymean-file.bin"] = b"\x93NUMPY not the file"
    published("tinymean", b"the published bytes", f"{url}/good", table="MEANS")
    with pytest.raises(FormatError, match=r"does not start with the published"):
        read_mean_image("tinymean", 8, progress=False)
    assert not list(hub.cache_dir().glob("tinymean*"))  # never kept, never used
    monkeypatch.chdir(tmp_path)
    evaluate = load_script("evaluate").main
    with pytest.raises(SystemExit) as e:
        evaluate(["--data", str(tmp_path), "--weights", "torchvision", "--mean", "ilsvrc_2021_mean"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--mean" in err[0] and "ilsvrc_2012_mean" in err[0], err
