"""Shared fixtures (one small synthetic ImageNet tree and its preprocessed output per test session), and
how the suite runs: on two pytest-xdist workers when it is installed, the longest files first."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from data.procs import follow_parent
from tests import children

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.temp_guard"]  # each test and fixture leaves its temporary directory empty
# One torch thread per process (inherited by every subprocess, xdist worker and replica): the suite runs
# two workers that start replicas and loader processes on 2 cores, and torch's OpenMP threads then
# spin-wait against each other: 43.5 s of CPU instead of 23.5 s for the same three training tests,
# measured side by side. test_determinism sets 2 threads where the thread count matters.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_script(*args: str, cpu_s: float = 120, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a repository script with this interpreter; output captured as text. `cpu_s`: the CPU seconds its
    processes may use; it may take as long as it needs while it makes progress (tests/children.py)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return children.run([sys.executable, *args], cwd=REPO, cpu_s=cpu_s,
                          env=full_env, **kw)


@contextlib.contextmanager
def signal_handlers_kept():
    """train.py's main, called in this process, installs its Ctrl-C/SIGTERM/SIGHUP handlers: put back the previous
    ones afterwards (module fixtures that train in-process use it too: they run outside the test's own)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@pytest.fixture(autouse=True)
def _own_signal_handlers():
    with signal_handlers_kept():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Fixtures too (module and session ones run outside any test's own): one that trains in-process left
    train.py's handlers behind, and a later test in the same worker met them instead of the default."""
    with signal_handlers_kept():
        yield


def _session_data(name: str, params: dict, tmp_path_factory, build) -> tuple[Path, object]:
    """A session fixture's data: under mutmut, one build per mutation run for the mutants outside data/
    (tests/session_data.py)."""
    from tests import session_data
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    return session_data.built(name, json.dumps(params, sort_keys=True), tmp_path_factory.mktemp, build,
                              shared=a_mutants_session() and not session_data.mutant_builds_it(mutant),
                              cache=REPO / ".session-data", code=REPO / session_data.BUILT_BY)


SYNTH = {"num_classes": 4, "train_per_class": 12, "val_per_class": 4, "seed": 0, "min_side": 48, "max_side": 160}


@pytest.fixture(scope="session")
def synth(tmp_path_factory) -> tuple[Path, dict]:
    """A synthetic ImageNet-format tree (flat val with both label files) with every quirk."""
    from data.synthetic import generate
    return _session_data("synth", SYNTH, tmp_path_factory, lambda root: generate(root, **SYNTH))


@pytest.fixture(scope="session")
def prep(synth, tmp_path_factory) -> tuple[Path, dict]:
    """`synth` preprocessed at 64x64, 8 images per file, Kaggle val labels."""
    from data.preprocess import Options, preprocess
    root, _ = synth
    return _session_data(
        "prep", {"synth": str(root), "size": 64, "per_file": 8}, tmp_path_factory,
        lambda out: preprocess(root / "train", out, root / "val", root / "LOC_val_solution.csv",
                               Options(size=64, per_file=8), workers=2, quiet=True))


@pytest.fixture(scope="session")
def train_data(synth, tmp_path_factory) -> Path:
    """`synth` preprocessed at 72x72 (alexnet's smallest crop is 67), 16 images per file."""
    from data.preprocess import Options, preprocess
    root, _ = synth

    def build(out: Path) -> None:
        preprocess(root / "train", out, root / "val", root / "val.txt", Options(size=72, per_file=16),
                   workers=2, quiet=True)
    return _session_data("train_data", {"synth": str(root), "size": 72, "per_file": 16}, tmp_path_factory,
                         build)[0]


def load_script(name: str, folder: str = "scripts"):
    """A scripts/<name>.py (or tools/<name>.py) as a module, to call its main() in-process (fast
    error-path tests)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"_script_{name}", REPO / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def a_mutants_session() -> bool:
    """Whether this pytest session runs one mutant's tests (mutmut sets MUTANT_UNDER_TEST to the mutant's
    name in the process it forks for it; "stats" and "fail" are its own runs on the unmutated code)."""
    return os.environ.get("MUTANT_UNDER_TEST", "") not in ("", "stats", "fail")


def under_mutmut() -> bool:
    """Whether these tests run inside mutmut. Its fork server imports the test modules once, before any
    mutant is set, and forks a process per mutant from it: what a module decides at import (a Hypothesis
    property's example count) must be decided by this, not by a_mutants_session()."""
    return "mutmut.__main__" in sys.modules or a_mutants_session()  # its command line, not a tool reading its files


def _under_a_mutant() -> None:
    """Per mutant's session (pytest_configure; its fork server imported this file before any mutant was set):

    - a failing Hypothesis example is a killed mutant: no shrinking it (shrinking reruns the test many times
      to find the smallest failure, which only a person reading it needs);
    - the heap the session was forked with (torch, the collected tests) is frozen: a full garbage collection
      walked all of it (pytest's unraisable-exception check makes five at a session's end, 1.0 of the 1.3 s
      a one-test mutant cost here; frozen, 0.3 s; pyproject.toml now leaves that check out of mutmut's
      sessions). A forked session that ends in os._exit has nothing of that heap to free;
    - the server's own signal handlers are put back to the system's: a fork keeps Python's handlers, and the
      server's SIGTERM handler SIGKILLs the mutants it was running when it forked and exits 0. A test's forked
      child stopped with SIGTERM (a pool's worker) would have killed other mutants' sessions and passed. The
      server ignores SIGINT; pytest_configure gives it Ctrl-C's handler after this."""
    import gc

    from hypothesis import Phase, settings
    gc.freeze()
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):  # those no process may handle
            if callable(signal.getsignal(sig)) and signal.getsignal(sig) is not signal.default_int_handler:
                signal.signal(sig, signal.SIG_DFL)
    settings.register_profile("mutmut", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("mutmut")


def pytest_collection_finish(session):
    """What the imports and the collection made (torch, the test modules, the items) goes to the collector's
    permanent generation: the full collections of the run (about a dozen per worker) and pytest's five at
    its end walked it each time, as train.py's startup.imported() spares every tool's process."""
    import gc
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """The parse trees the source walks cached (tests/imports.py, a third of a worker's heap) are let go
    before pytest's last check walks the heap five times (its clean-up, after this hook); a tree holds no
    cycle, so it is freed at once.

    Under mutmut every session (one per mutant) ends with os._exit, so pytest's lock on its temporary
    folder stays and pytest keeps the folder for three days: a few thousand mutants filled 77 GB of /tmp
    and the disk. A mutant's result is mutmut's verdict, not files: its folder goes."""
    imports = sys.modules.get("tests.imports")
    for cached in (getattr(imports, "_parsed", None), getattr(imports, "_parsed_imports", None)):
        if cached is not None:
            cached.cache_clear()
    if not under_mutmut():
        return
    base = getattr(getattr(session.config, "_tmp_path_factory", None), "_basetemp", None)
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)


def examples(n: int) -> int:
    """How many examples a Hypothesis property draws: n in the suite (what CI runs); a fifth (at least 3)
    when mutmut runs the test once per mutant (under_mutmut()), where the named cases beside each
    property carry most of the load and the time goes into the number of mutants, and in `make test-fast`
    (ALEXNET_FAST_TIER), the edit loop's tier, which must stay within its 60 s."""
    fewer = under_mutmut() or in_fast_tier()
    return max(3, n // 5) if fewer else n


FAST_TIER = "ALEXNET_FAST_TIER"  # set by `make test-fast`


def in_fast_tier() -> bool:
    """Whether this is `make test-fast`: generated cases are sampled there; the suite runs them all."""
    return bool(os.environ.get(FAST_TIER))


def settings_of(case) -> set[tuple]:
    """The (where, value) pairs a named case sets: a dict's items, a dataclass's fields, a tuple's parts."""
    if isinstance(case, dict):
        return {(k, repr(v)) for k, v in case.items()}
    if dataclasses.is_dataclass(case):
        return settings_of(dataclasses.asdict(case))
    if isinstance(case, tuple):
        return {(i, *pair) for i, part in enumerate(case) for pair in settings_of(part)}
    return {((), repr(case))}


def tier_cases(cases: dict) -> list[str]:
    """The names of the named cases a test runs: all of them in the suite (and under mutmut); in the fast
    tier the fewest, chosen greedily in the cases' order, whose settings together take every value that any
    case sets, so each setting still runs in the edit loop (a new case with a new setting joins it)."""
    if not in_fast_tier():
        return list(cases)
    left, chosen = set().union(*map(settings_of, cases.values())), []
    while left:
        best = max(cases, key=lambda name: len(settings_of(cases[name]) & left))  # the first of the best
        chosen.append(best)
        left -= settings_of(cases[best])
    return [name for name in cases if name in chosen]


def tiny_overrides(data_root: Path, run_dir: Path, **extra) -> list[str]:
    """Dotted overrides for a seconds-long alexnet run on `train_data`."""
    base = {"data.root": str(data_root), "data.crop": 67, "model.width": 0.125, "model.init": "torch",
            "train.batch_size": 8, "train.epochs": 2, "train.log_every": 2, "train.lr_steps": [1],
            "run.dir": str(run_dir), "run.progress": False, "run.tensorboard": False}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def sigint_inside_the_pool(monkeypatch, module, where: str) -> list[bool]:
    """Ctrl-C sent from inside concurrent.futures' own call (`module.cf.wait`, or ProcessPoolExecutor.submit),
    the first time it is called: its handler runs there. Returns a list that each call that returned appends
    to. Skips outside the main thread, where Python sets no signal handlers."""
    import concurrent.futures as cf
    import threading
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    returned: list[bool] = []

    def inside(real):
        def call(*args, **kwargs):
            if not returned:
                signal.raise_signal(signal.SIGINT)
            result = real(*args, **kwargs)
            returned.append(True)
            return result
        return call
    if where == "wait":
        monkeypatch.setattr(module.cf, "wait", inside(cf.wait))
    else:
        monkeypatch.setattr(cf.ProcessPoolExecutor, "submit", inside(cf.ProcessPoolExecutor.submit))
    return returned


# -- running the suite ---------------------------------------------------------------------------------

WORKERS = 2  # most tests wait on subprocesses or sleeps: two workers keep 2 cores busy
# xdist hands out work in collection order: the longest files first, so that none of them starts last
# and ends the run alone (a module whose tests share a fixture is one group on one worker: test_write_points'
# is some 50 s). Files not named here follow, in their usual order. By the summed durations of a whole run
# (pytest --durations=0, 2026-11-28).
LONGEST_FIRST = ("test_gpu_check.py", "test_train.py", "test_write_points.py", "test_elastic.py",
                 "test_parallel.py", "test_input_faults.py", "test_checkpoint.py", "test_model_parallel.py",
                 "test_benchmarks.py", "test_figures.py", "test_children.py", "test_parallel_math.py",
                 "test_caffe.py", "test_archives.py", "test_guarantees.py", "test_parallel_runs.py",
                 "test_doc_commands.py", "test_report.py", "test_loader.py", "test_theano_weights.py",
                 "test_predict.py")


def pytest_configure(config):
    """An xdist worker of a grouped run groups and orders its tests (pytest_configure_node).

    A shell's background job (`make test &`) starts with SIGINT ignored, nohup with SIGHUP ignored, and so
    would every process the tests start (exec keeps an ignored signal ignored): the tests that send a child
    Ctrl-C or SIGHUP need the terminal's default. A handler, unlike SIG_IGN, is reset to the default on
    exec: SIGHUP gets one that does nothing, so the suite itself still outlives its terminal."""
    if getattr(config, "workerinput", {}).get("alexnet_loadgroup"):
        config.option.loadgroup = True  # what xdist itself reads to send a group to one worker
    if a_mutants_session():
        _under_a_mutant()
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _outlive_the_terminal)
    follow_parent()  # a suite a tool starts (a mutant's replay, gpu_check's GPU tests) ends with that tool
    if getattr(getattr(config, "option", None), "numprocesses", None) and not hasattr(config, "workerinput"):
        from tests import rewrite_cache  # xdist's controller: the workers' rewritten test modules, once
        config.stash[_REWRITING] = rewrite_cache.start(config)


_REWRITING = pytest.StashKey()
_REMOVING = pytest.StashKey()


def pytest_sessionstart(session):
    """The earlier runs' folders that pytest removes when this run ends (tmp_path_retention_count) go now,
    in a thread, while the tests run: at the end the removal held up the edit loop's every run by 2.6-3 s
    (1.2 GB of the fast tier's folders; nothing to remove on a fresh machine)."""
    session.config.stash[_REMOVING] = _earlier_runs_removed_meanwhile(session.config)


def pytest_unconfigure(config):
    """Threads started here are done before the run ends. Then, after pytest's own clean-up (its last check
    for unraisable exceptions makes five full garbage collections after this hook), the heap is frozen
    (atexit): the interpreter's teardown walked all of it again, 3.6-3.9 s of each xdist worker's end."""
    for key in (_REWRITING, _REMOVING):
        if (thread := config.stash.get(key, None)) is not None:
            thread.join()
    import atexit
    import gc
    atexit.register(gc.freeze)


def _earlier_runs_removed_meanwhile(config):
    """A thread removing what pytest's own clean-up at exit would (the same function with the same
    arguments: the numbered folders beyond those it keeps, never one whose run still holds its lock), or
    None: a worker (its folder is the controller's), a given --basetemp, or a pytest without that function."""
    import threading
    try:
        from _pytest.pathlib import LOCK_TIMEOUT, cleanup_numbered_dir
        factory = config._tmp_path_factory
        if hasattr(config, "workerinput") or factory._given_basetemp is not None:
            return None
        keep = 0 if config.getini("tmp_path_retention_policy") == "none" else int(
            config.getini("tmp_path_retention_count"))
        base = factory.getbasetemp()
    except (ImportError, AttributeError):
        return None
    thread = threading.Thread(target=cleanup_numbered_dir, name="earlier pytest runs' folders removed",
                              args=(base.parent, "pytest-", keep, base.stat().st_mtime - LOCK_TIMEOUT))
    thread.start()
    return thread


def _outlive_the_terminal(signum, frame) -> None:
    """SIGHUP in the suite's own process: nothing (see pytest_configure)."""


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest` with no test paths runs the whole suite on WORKERS pytest-xdist workers (--dist
    loadgroup, see _group_by_module_fixtures). Named paths, `-m gpu` (one GPU, timing-sensitive), --pdb,
    -n N or -p no:xdist run as asked; without pytest-xdist the suite runs in this one process."""
    opt = config.option
    if (getattr(opt, "numprocesses", 0) is not None or hasattr(config, "workerinput")
            or config.args_source != pytest.Config.ArgsSource.TESTPATHS or "gpu" in (opt.markexpr or "")
            or opt.usepdb or opt.collectonly):
        return
    opt.numprocesses = WORKERS
    if opt.dist == "no":
        opt.dist, opt.loadscopereorder = "loadgroup", False


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist's workers parse the command line again (xdist/remote.py), so they never see the --dist that
    pytest_cmdline_main set here: without a word they neither grouped nor ordered the tests, and both made
    each module's fixtures (gpu_check's four CPU-twin runs twice). The word goes in the worker's input."""
    node.workerinput["alexnet_loadgroup"] = node.config.option.dist == "loadgroup"


def _file_rank(item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def _group_by_module_fixtures(items) -> None:
    """The tests of a file that share a module-scoped fixture, directly or through one another, become
    one xdist group: one worker makes the fixture once and runs them in order. The others go one by one
    to whichever worker is free."""
    parent: dict[tuple, tuple] = {}

    def root(key: tuple) -> tuple:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key
    keys = []
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        mine = [(item.path.name, name) for name in sorted(defs) if defs[name][-1].scope in ("module", "class")]
        for key in mine[1:]:
            parent[root(key)] = root(mine[0])
        keys.append(mine[0] if mine else None)
    for item, key in zip(items, keys):
        if key is not None:
            item.add_marker(pytest.mark.xdist_group(":".join(root(key))))


# The interpreter's own probe: the first platform.processor() of a process runs `uname -p` (Python 3.11), and
# h5py's import asks for it, so the test that first imported h5py "started a process" (a file run alone failed
# where the whole suite, which had imported it earlier, passed). Asked once here, before any test; cached.
platform.processor()


# `make test-fast` (-m "not processes and not slow") leaves out the tests that start processes: a test without
# those marks that starts one fails, naming the mark it needs, in every run (make test too, so CI catches a
# missing mark, not only the tier), so the tier stays what it says by construction. Fixtures (the session's
# preprocessed data) may start processes; a test's own call may not. `gpu` tests run on the GPU machine only
# (make gpu-check), where the tier is not run.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if any(item.get_closest_marker(mark) for mark in ("processes", "slow", "gpu")):
        yield
        return
    import multiprocessing.process

    def refuse(*args, **kwargs):
        pytest.fail(f"{item.nodeid} starts a process: mark it @pytest.mark.processes (make test-fast leaves such "
                    "tests out)", pytrace=False)
    saved = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start
    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = refuse, refuse
    try:
        yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = saved


# Skips that mean "an oracle is missing" (an import, or OpenCV without its Caffe importer): `make test`
# installs requirements-dev.txt (with requirements-test.txt) and sets ALEXNET_ORACLES_REQUIRED, and there such
# a skip fails the test, so that CI never passes over the comparisons with OpenCV and TensorBoard, nor mutmut.
ORACLE_SKIPS = ("could not import", "has no Caffe importer")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("ALEXNET_ORACLES_REQUIRED") and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if any(s in reason for s in ORACLE_SKIPS):
            report.outcome = "failed"
            report.longrepr = (f"an oracle test skipped where the oracles are required ({reason}); "
                               "install requirements-dev.txt (make test does)")


def _fastest_first_for_a_mutant(items) -> None:
    """Under mutmut (a mutant's run, `-x`: the first failure ends it), the tests of the mutated function run
    fastest first, by the durations mutmut recorded, so that a mutant a quick test kills costs that test."""
    import json
    if not a_mutants_session():
        return
    try:
        durations = json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip where CUDA is absent (CI); on a GPU machine run them with -m gpu.
    Under xdist, the longest files first (a stable sort: each file keeps its order), grouped. Under mutmut,
    the fastest first."""
    _fastest_first_for_a_mutant(items)
    # An xdist worker, which collects, has option.dist "no" and option.loadgroup instead (xdist/remote.py's
    # setup_config, or pytest_configure here for the run that pytest_cmdline_main made grouped).
    if getattr(config.option, "dist", "no") == "loadgroup" or getattr(config.option, "loadgroup", False):
        items.sort(key=_file_rank)
        _group_by_module_fixtures(items)
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- a local server of weight files (tests/weights_server.py) -------------------------------------------------


@pytest.fixture
def server():
    """(URL, Files): a local HTTP server of weight files (tests/weights_server.py) for the test's length."""
    import http.server
    import threading

    from tests.weights_server import Files
    Files.files, Files.log = {}, []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    httpd.daemon_threads = True
    # shutdown() waits for the loop's next poll: 0.5 s by default, per test
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", Files
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def published(tmp_path, monkeypatch):
    """An empty torch hub cache in tmp_path, and `add(name, body, url)`: a registry entry for a file served."""
    import hashlib

    from alexnet.weights import hub
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.delenv(hub.MIRROR_ENV, raising=False)

    def add(name: str, body: bytes, url: str, algorithm: str = "sha256", table: str = "PUBLISHED") -> hub.Published:
        """`table`: hub.PUBLISHED (weights) or hub.MEANS (mean images)."""
        entry = hub.Published(f"{name}-file.bin", f"{url}/{name}-file.bin",
                              f"{algorithm}:{hashlib.new(algorithm, body).hexdigest()}", "a test file")
        monkeypatch.setitem(getattr(hub, table), name, entry)
        return entry
    return add


@contextlib.contextmanager
def pipe_nobody_writes(path: Path):
    """A named pipe at `path` for the block; yields a list that gets an entry if anything opens it for
    reading (it is then fed nothing and closed, so that the reader ends: a failure, not a hang)."""
    import threading
    os.mkfifo(path)
    opened, done = [], threading.Event()

    def writer():
        while not done.is_set():
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads it
            except OSError:
                done.wait(0.01)
                continue
            opened.append(True)
            os.close(fd)
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield opened
    finally:
        done.set()
        thread.join()
