"""Shared test set-up."""

import compileall
import gc
import os

# One CPU thread per process (read when torch loads, and inherited by every process a test starts): the two
# workers' tests, and the ranks they start, already fill both cores, and a second OpenMP thread per process only
# competes for them (docs/testing.md: the suite took twice the CPU time with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Inductor builds the suite's CPU kernels scalar and probes no vector instruction sets: each kernel compiles faster,
# and what the compiled tests check (graphs, AC partitions, collectives, numerics) is the same (docs/testing.md).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def pytest_sessionstart(session):
    """The project's modules compiled to bytecode once, before the suite starts its training processes: where
    PYTHONDONTWRITEBYTECODE is set (as on CI's machines), each of those hundreds of processes would otherwise
    compile the sources again (about 0.6 s of CPU each)."""
    for package in ("engine", "models", "parallelize", "tools"):
        compileall.compile_dir(os.path.join(ROOT, package), quiet=1)


def _xdist_controller(config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def pytest_configure(config):
    """Under xdist, the controller makes the session's shared folder before it starts the workers
    (tests/workers.py), and starts the README's main job there when the whole suite runs (the workers each collect
    the tests, and either one may check the job)."""
    if _xdist_controller(config):
        from tests import test_default_run, workers

        folder = workers.start_session()
        whole_suite = not config.option.keyword and not config.option.markexpr and all(
            os.path.abspath(arg.split("::")[0]) in (ROOT, os.path.join(ROOT, "tests")) for arg in config.args)
        if whole_suite and not config.option.collectonly:
            test_default_run.start_in_background(os.path.join(folder, "readme_job"))


def pytest_collection_modifyitems(config, items):
    """The README's main job (a minute of compute on 2 cores) starts now, in the background at idle priority, when
    other tests run in this session too; its test moves to the end, where it checks the finished run."""
    readme = [item for item in items if item.nodeid.split("::")[0].endswith("test_default_run.py")]
    if readme and len(readme) < len(items) and not config.option.collectonly:
        from tests import test_default_run, workers

        items[:] = [item for item in items if item not in readme] + readme
        if workers.session_folder() is None:  # (under xdist, the controller starts it)
            test_default_run.start_in_background()


def pytest_collection_finish(session):
    """What collection imported (torch, the engine, the test modules) moves to the permanent generation: the
    worker's full garbage collections, a dozen or more over a file of in-process runs, stop scanning it (about 40%
    of their time)."""
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, each test holds the machine shared or alone (tests/workers.py) from its set-up to its teardown."""
    from tests import workers

    workers.begin_test(item.nodeid)
    try:
        yield
    finally:
        workers.end_test()


def pytest_sessionfinish(session):
    from tests import test_default_run, workers

    test_default_run.discard_background()
    if _xdist_controller(session.config):
        workers.end_session()


@pytest.fixture(autouse=True, scope="module")
def fresh_compiler_caches():
    """Each test module ends with torch.compile's in-memory caches emptied. Dynamo keeps one cache entry per
    graph of a compiled function's code, up to a recompile limit (8), across everything one process runs: the
    split weights' optimizer update (engine/optim.py), compiled for each test's parameter shapes, would add up
    to it over the suite, where a training process compiles it once per parameter group."""
    yield
    torch._dynamo.reset()
