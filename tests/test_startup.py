"""alexnet/startup.py in-process: the collector is off while a script imports and back on, with the imports
frozen, once it runs (every script through the real entry: test_script_help.py)."""
from __future__ import annotations

import gc

import pytest

from alexnet import startup


@pytest.fixture
def collector():
    """The worker's collector as it was: on, and frozen if it was (conftest freezes what the collection
    made; Python cannot unfreeze a part, and what the test made is freed by its count of references)."""
    assert gc.isenabled()
    was = gc.get_freeze_count()
    yield
    startup.done()
    startup.imported()
    gc.freeze() if was else gc.unfreeze()
    gc.enable()


def test_the_imports_are_frozen_and_collection_is_back_on(collector):
    before = gc.get_freeze_count()
    startup.quiet_start("__main__", "x.py")
    assert not gc.isenabled()
    made = [[i] for i in range(5000)]  # what the heavy imports make: containers the collector tracks
    startup.imported()
    assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)
    startup.imported()  # a second call (protect_streams after protect_streams) changes nothing
    assert gc.isenabled()


def test_collection_left_off_by_the_embedder_stays_off(collector):
    gc.disable()
    startup.quiet_start("__main__", "x.py")
    startup.imported()
    assert not gc.isenabled()


def test_imported_as_a_module_nothing_changes(collector):
    startup.quiet_start("scripts.evaluate", "evaluate.py")
    assert gc.isenabled()
    before = gc.get_freeze_count()
    startup.imported()
    assert gc.isenabled() and gc.get_freeze_count() == before
