"""Shared fixtures: a tiny training config on a small slice of the embedded corpus."""

import os

import pytest

from tandem.models import flavors

# Every process the suite starts (ranks, CLI runs, servers) inherits this: one that dies of a signal
# prints its Python stack, where otherwise its launcher reports only an exit code
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# ... and one intra-op thread, as this process does (pytest_configure): two xdist workers share the
# suite's 2 cores, and on an oversubscribed core OpenMP's spinning threads only lose time (measured:
# an in-process fine-tuning test 17% slower with 2 threads than with 1 beside two busy processes)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# ... and inductor's CPU kernels in scalar C++: what the suite checks of train.compile is the
# graphs (capture, partitioning, checkpointing, collectives, numerics), which production lowers to
# Triton or NPU kernels anyway; the vectorised C++ costs gcc the most of a cold compile (measured on
# 2 cores: the compiled throughput bench 47 s cold with it, 29 s without; test_compile.py and
# test_loss_syncs.py 101 s and 64 s)
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# ... and compiled in the compiling process itself: inductor's default pool of compile workers (one
# per core) has each worker import torch first, in every rank and test process that compiles, for
# kernels a single gcc call each (measured: two compile tests 27.0 s of CPU with the pool, 25.0 s
# without, cold cache)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

FAULT_INJECTION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_injection")


def fault_env(env: dict, **faults: str) -> dict:
    """`env` for a tandem process with faults injected from outside
    (fault_injection/sitecustomize.py reads the TANDEM_TEST_* variables `faults` sets)."""
    path = os.pathsep.join([FAULT_INJECTION] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                else []))
    return {**env, **faults, "PYTHONPATH": path}


DEBUG_MODEL = flavors.overrides("debug")
"""The suite's model: the `debug` flavor (models/flavors.py; 2 layers of width 32, 4 experts,
vocabulary 512) as `key=value` overrides. Tests that need a variant append its changes (later
overrides win)."""

TINY_DATA = ["data.stdlib_max_bytes=200000", "data.vocab_size=512", "data.seq_len=32",
             "train.micro_batch_size=2"]
"""A 200 kB slice of the embedded corpus with a 512-token BPE (the flavor's vocabulary), 32-token
windows, 2 sequences per micro-batch."""

QUIET = ["train.dtype=fp32", "logging.wandb=false", "logging.progress=false"]
"""fp32 on every CPU, no wandb, no progress bar."""

TINY_OVERRIDES = DEBUG_MODEL + TINY_DATA + QUIET + [
    "train.warmup_steps=2", "eval.interval=0", "mtp.num_steps=2", "model.max_seq_len=64",
]
"""The suite's seconds-long CPU job, on top of recipes/tiny.yaml: the debug model at K=2, no
evaluator."""


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """One cache of the embedded-corpus slices (each slice's tokenizer and token files, keyed by
    its settings) for the whole run, shared by both xdist workers and every process they start: a
    slice is prepared once (3-5 s each time otherwise) under a file lock, so the worker or process
    that comes second waits for it and reads it (test_data_stdlib.py checks the concurrency)."""
    base = tmp_path_factory.getbasetemp()
    # a worker's base temp is popen-gwN/ under the run's own directory, which both workers share
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "tandem_cache"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_base(corpus_cache):
    """TINY_OVERRIDES with the session's corpus cache (no run directory)."""
    return TINY_OVERRIDES + [f"data.cache_dir={corpus_cache}"]


@pytest.fixture
def tiny_overrides(corpus_cache, tmp_path):
    """Overrides for a seconds-long CPU run in a fresh run directory."""
    return TINY_OVERRIDES + [f"data.cache_dir={corpus_cache}",
                             f"run.dir={os.path.join(str(tmp_path), 'run')}"]


@pytest.fixture
def fresh_dynamo():
    """An empty dynamo cache: the suite compiles blocks of many shapes in one process, and a code
    object past dynamo's recompile limit silently runs eager, which changes what a compile test
    sees."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# test module -> the names of its {layout: world size} tables that worker.py trains
TRAINING_LAYOUT_TABLES = {
    "test_parallel_equivalence": ("LAYOUTS", "BF16_LAYOUTS", "ACCUMULATION"),
    "test_qwen4_layouts": ("LAYOUTS", "BF16_LAYOUTS"),
    "test_compile_layout": ("EAGER", "COMPILED"),
    "test_piece_units": ("LAYOUTS", "BF16_LAYOUTS"),
    "test_context_parallel": ("LAYOUTS", "BF16_LAYOUTS"),
    "test_router_bias_layouts": ("LAYOUTS",),
}


@pytest.fixture(scope="session")
def shared_launches(request, tmp_path_factory):
    """One launch per world size (its ranks forked, tests/processes.py) for the workers of every
    tests/distributed module collected in this session (tests/distributed/shared_launch.py): the
    layouts of the training-equivalence tables above, trained by worker.py into one directory
    ("training"; a layout two modules check trains once; compiled layouts last, as they switch
    dynamo settings), then the jobs modules declare (`SHARED_JOBS`: (world, worker module,
    arguments)). Each launch starts its ranks and forms the process group once, which on a 2-core
    machine costs as much as several of the jobs."""
    from tests.distributed.shared_launch import SharedLaunches

    # the collected modules by their last dotted name (tests.distributed.test_x -> test_x)
    collected = {item.module.__name__.rsplit(".", 1)[-1]: item.module
                 for item in request.session.items if getattr(item, "module", None) is not None}
    by_world = {}
    for name, module in collected.items():
        for world, worker, args in getattr(module, "SHARED_JOBS", ()):
            by_world.setdefault(world, []).append((name, worker, list(args)))
    training = {}
    for name, tables in TRAINING_LAYOUT_TABLES.items():
        module = collected.get(name)
        if module is None:
            continue
        for table in tables:
            for layout, world in getattr(module, table).items():
                if layout not in training.setdefault(world, []):
                    training[world].append(layout)
    for world, layouts in training.items():
        layouts.sort(key=lambda layout: "train.compile=true" in layout)
        # first: the training layouts ran 20-45% slower after the other jobs than before them
        # (measured, 2 ranks; the cause is not found), and nothing the other jobs run is compiled
        by_world.setdefault(world, []).insert(0, ("training", "tests.distributed.worker", layouts))
    launches = SharedLaunches(tmp_path_factory.mktemp("launches"))
    launches.run(by_world)
    return launches


@pytest.fixture(scope="session")
def training_layout_runs(shared_launches):
    """The directory of every training-equivalence layout's per-rank results."""
    return shared_launches.check("training")


@pytest.fixture(scope="module")
def shared_jobs(request, shared_launches):
    """The requesting module's directory, once its `SHARED_JOBS` ran to their end."""
    return shared_launches.check(request.module.__name__.rsplit(".", 1)[-1])


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """The suite runs on two pytest-xdist workers (`-n 2 --dist loadgroup`, pyproject.toml). Every
    file of tests/distributed is one group, run in file order on one worker: two multi-rank launches
    at once put twice as many ranks on the two cores, and a launch whose ranks meet in many small
    collectives (the evaluator's decode steps) then waits on the scheduler for every one of them
    (measured: an evaluator launch ran past its 10-minute limit beside an 8-rank one). The other
    worker takes the remaining files, each whole, so a module-scoped fixture (a trained run) runs
    once; the distributed group goes first, as the longest, and the training-equivalence modules
    first within it, as they share `training_layout_runs`. Files with slow tests come before the
    quick ones, which fill the end."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        module = os.path.splitext(os.path.basename(path))[0]
        group = "distributed" if path.startswith("tests/distributed/") else path
        item.add_marker(pytest.mark.xdist_group(group))
        slow = any(item.get_closest_marker(m) for m in ("slow", "distributed"))
        rank = (
            0
            if module in TRAINING_LAYOUT_TABLES
            else 1
            if group == "distributed"
            else 2
            if slow
            else 3
        )
        item.stash[_RANK] = rank
    items.sort(key=lambda item: item.stash[_RANK])  # stable: file order kept within each rank


_RANK = pytest.StashKey[int]()


def pytest_configure(config):
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
