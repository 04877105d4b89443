"""Names and pieces (issue 14, item 1): every name webdataset 1.0.2's modules define resolves in wdsraft's
module of the same name, and the pieces pull from upstream exactly as webdataset's do."""

from __future__ import annotations

import importlib
import pickle
import random
import subprocess
import sys
import types

import pytest
import webdataset

import wdsraft as wds

MODULES = [
    "autodecode",
    "cache",
    "compat",
    "extradatasets",
    "filters",
    "gopen",
    "handlers",
    "mix",
    "multi",
    "pipeline",
    "pytorch",
    "shardlists",
    "tariterators",
    "tenbin",
    "typecheck",
    "utils",
    "writer",
]


def _defined(module: types.ModuleType) -> set[str]:
    """The names a module defines itself (not what it imports), and its ``__all__``."""
    own = {
        name
        for name, value in vars(module).items()
        if not name.startswith("__")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", module.__name__) == module.__name__
    }
    return own | set(getattr(module, "__all__", ()))


@pytest.mark.parametrize("name", MODULES)
def test_every_name_of_webdatasets_module_resolves_in_wdsraft(name) -> None:
    try:
        theirs = importlib.import_module(f"webdataset.{name}")
    except ImportError as error:  # (multi needs pyzmq: then ours fails the same way)
        with pytest.raises(ImportError, match=str(error.name)):
            importlib.import_module(f"wdsraft.{name}")
        return
    ours = importlib.import_module(f"wdsraft.{name}")
    if getattr(webdataset, name, None) is theirs:  # (webdataset.gopen is the function, as wds.gopen)
        assert getattr(wds, name) is ours
    missing = sorted(n for n in _defined(theirs) if not hasattr(ours, n))
    assert not missing, missing


def test_every_top_level_name_of_webdataset_resolves() -> None:
    missing = [n for n in dir(webdataset) if not n.startswith("__") and not hasattr(wds, n)]
    assert not missing, missing


def test_modules_resolve_as_attributes_right_after_import() -> None:
    """``import wdsraft as wds; wds.typecheck``... with no other import first (a fresh interpreter)."""
    names = [name for name in MODULES if name != "multi"]  # (multi needs pyzmq, and webdataset's is not eager)
    code = f"import wdsraft as wds; print(all(hasattr(wds, n) for n in {names!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"


def _pulls_at_each_batch(lib, batchsize: int, n: int) -> list[int]:
    pulled = []

    def counted():
        for i in range(n):
            pulled.append(i)
            yield i

    return [len(pulled) for _ in lib.filters._batched(counted(), batchsize, collation_fn=None)]


@pytest.mark.parametrize("batchsize, n", [(1, 5), (3, 10), (4, 12), (5, 3)])
def test_batched_pulls_as_webdatasets(batchsize, n) -> None:
    """A full batch goes out when the item after it arrives, as in webdataset's _batched."""
    assert _pulls_at_each_batch(wds, batchsize, n) == _pulls_at_each_batch(webdataset, batchsize, n)


def test_a_live_rng_shared_by_a_shuffle_after_batched_draws_as_webdatasets() -> None:
    """Stages pulled one item apart would draw from a shared live RNG in another order."""

    def stream(lib) -> list:
        rng = random.Random(4)

        def jitter(src):
            for item in src:
                yield item, rng.random()

        pipeline = lib.DataPipeline([list(range(23))], jitter, lib.batched(4, collation_fn=None))
        pipeline.append(lib.filters.pipelinefilter(lambda src: ((b, rng.random()) for b in src))())
        return list(pipeline)

    assert stream(wds) == stream(webdataset)


@pytest.mark.parametrize(
    "name, args, kw",
    [
        ("shuffle", (100,), {"initial": 10}),
        ("batched", (4,), {"partial": False}),
        ("unbatched", (), {}),
        ("unlisted", (), {}),
        ("rsample", (0.3,), {}),
        ("slice", (2, 10), {}),
    ],
)
def test_curried_stage_attributes_are_webdatasets(name, args, kw) -> None:
    """webdataset's curried stages expose .f, .args and .kw (code reads them to inspect a pipeline)."""
    theirs, ours = getattr(webdataset.filters, name)(*args, **kw), getattr(wds.filters, name)(*args, **kw)
    assert (ours.args, ours.kw, ours.f.__name__) == (theirs.args, theirs.kw, theirs.f.__name__)
    copied = pickle.loads(pickle.dumps(ours))
    assert (copied.args, copied.kw) == (ours.args, ours.kw)
