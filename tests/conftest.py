"""Shared test set-up."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def fresh_compiler_caches():
    """Each test module ends with torch.compile's in-memory caches emptied. Dynamo keeps one cache entry per
    graph of a compiled function's code, up to a recompile limit (8), across everything one process runs: the
    split weights' optimizer update (engine/optim.py), compiled for each test's parameter shapes, would add up
    to it over the suite, where a training process compiles it once per parameter group."""
    yield
    torch._dynamo.reset()
