"""Shared test set-up."""

import compileall
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_sessionstart(session):
    """The project's modules compiled to bytecode once, before the suite starts its training processes: where
    PYTHONDONTWRITEBYTECODE is set (as on CI's machines), each of those hundreds of processes would otherwise
    compile the sources again (about 0.6 s of CPU each)."""
    for package in ("engine", "models", "parallelize", "tools"):
        compileall.compile_dir(os.path.join(ROOT, package), quiet=1)


@pytest.fixture(autouse=True, scope="module")
def fresh_compiler_caches():
    """Each test module ends with torch.compile's in-memory caches emptied. Dynamo keeps one cache entry per
    graph of a compiled function's code, up to a recompile limit (8), across everything one process runs: the
    split weights' optimizer update (engine/optim.py), compiled for each test's parameter shapes, would add up
    to it over the suite, where a training process compiles it once per parameter group."""
    yield
    torch._dynamo.reset()
