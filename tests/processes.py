"""The suite's `tandem` commands, bench scripts and multi-rank workers, each in a process forked
from a warm interpreter.

A cold process spends about 4.5 s of CPU before its first line of work: importing torch (1.8 s),
DTensor (0.8 s), dynamo (1.7 s; torch.optim imports it) and the trainer. The suite starts a few
hundred such processes on its two cores (CLI runs, the ranks of every launch, bench workers), so
start-up was a sixth of its CPU. Here they are forked instead from a forkserver
(multiprocessing's) that imported those modules once (`PRELOAD`): a fork costs about 10 ms, and
the child runs from a clean import, not from a test process's state.

What a child gets is what the same command started cold gets: its working directory, exactly the
environment given (with the effects a Python start-up draws from it: `PYTHONPATH` entries and their
`sitecustomize`, which tests/fault_injection uses; `PYTHONFAULTHANDLER`; `PYTHONWARNINGS`;
`OMP_NUM_THREADS`), its own stdout and stderr, and its exit code, its exit handlers run. What
differs: every child shares the forkserver's hash seed, and environment variables that torch reads
at import (TORCHINDUCTOR_*, for one) take the forkserver's values, which are this session's.

A multi-rank launch (`world` > 1) gives each rank the variables torchrun's `--standalone` gives
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the
store), and like torchrun it stops the other ranks once one fails. torchrun itself (its agent, its
restarts) is what the README's documented launches (tests/e2e/test_readme_commands.py) and the
restart tests (tests/e2e/test_reliability.py) run, cold.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from multiprocessing.connection import wait
from typing import Callable, List, NoReturn, Optional, Sequence, Tuple

import torch

from tandem.trainer.cli import main as tandem_main
from tandem.trainer.parallel.layout import (
    exit_code_of,
    exit_without_finalisation,
    leave_distributed_process,
    run_as_process,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELOAD = ["torch", "torch.distributed.tensor", "torch._dynamo", "tandem.trainer.run",
           "tandem.trainer.loop"]
"""What the forkserver imports once, for every child: what any `tandem train` imports before its
first step."""

RANK_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
"""What a multi-rank launch adds: one intra-op thread per rank (2 shared cores), and no warnings
repeated by every rank."""

STOP_GRACE_S = 60
"""How long a rank asked to stop (SIGTERM) has before it is killed."""

Target = Tuple[str, object, Sequence]
"""What a child runs: ("tandem", "", args), ("module", dotted name, args) as `python -m`,
("code", source, args) as `python -c`, ("script", path, args) as `python path`, or
("function", a module-level function, args) called with them as a rank of `tandem` runs its
command."""

_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def tandem(args: Sequence[str], world: int = 1, **kwargs) -> subprocess.CompletedProcess:
    """`tandem ARGS` (on `world` ranks); keyword arguments as `command`'s."""
    return command(["tandem", *args], world, **kwargs)


def command(argv: Sequence[str], world: int = 1, *, cwd: str = ROOT, env: Optional[dict] = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """`argv` as `subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)` would run
    it, on `world` ranks: the `tandem` console script, or this interpreter with a script, `-m
    MODULE` or `-c CODE` (and their arguments). See `run`."""
    argv = [str(a) for a in argv]
    if argv[0] == "tandem":
        return run(("tandem", "", argv[1:]), world, cwd=cwd, env=env, timeout=timeout)
    if argv[0] != sys.executable:
        raise ValueError(f"{argv[0]!r}: only `tandem` or {sys.executable} is run forked")
    kind = {"-m": "module", "-c": "code"}.get(argv[1])
    target = (kind, argv[2], argv[3:]) if kind else ("script", argv[1], argv[2:])
    return run(target, world, cwd=cwd, env=env, timeout=timeout)


def run(target: Target, world: int = 1, *, cwd: str = ROOT, env: Optional[dict] = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """`target` in `world` forked processes, from `cwd` with environment `env` (default: this
    process's; a launch adds `RANK_ENV` and the rank's variables). The caller checks the return
    code: a single process's exit code (negative: the signal that ended it); for a launch 0, or 1
    once a rank failed (the others are then stopped, as torchrun does). `stdout` and `stderr` hold
    every rank's in rank order, read from files, so ranks stuck in a collective cannot block a
    reader. Past `timeout` (a deadlock) the ranks are stopped and the return code is -1."""
    env = dict(os.environ if env is None else env)
    port = _free_port() if world > 1 else None
    with tempfile.TemporaryDirectory(prefix="tandem-forked-") as logs:
        outs = [(os.path.join(logs, f"rank{r}.out"), os.path.join(logs, f"rank{r}.err"))
                for r in range(world)]
        procs = []
        for rank in range(world):
            rank_env = env if world == 1 else {**env, **RANK_ENV, **_rank_env(rank, world, port)}
            proc = _forkserver().Process(target=_child,
                                         args=(target, cwd, rank_env, *outs[rank]))
            proc.start()
            procs.append(proc)
        code, note = _wait(procs, timeout)
        stdout = "".join(_read(out) for out, _ in outs)
        stderr = "".join(_read(err) for _, err in outs) + note
    return subprocess.CompletedProcess(list(target), code, stdout, stderr)


def finish(main: Callable[[], Optional[int]]) -> NoReturn:
    """A worker module's entry point: `main` run the way a rank of `tandem` runs its command
    (`run_as_process`: no interpreter finalisation, where gloo's threads can abort a rank whose
    results are already written); at world size 1 it leaves the same way with main's code."""
    leave_distributed_process(run_as_process(main))


def _rank_env(rank: int, world: int, port: int) -> dict:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(procs: List, timeout: float) -> Tuple[int, str]:
    """Wait for every process; once one fails, stop the rest. (return code, a note for stderr)."""
    deadline, running, failed = time.monotonic() + timeout, list(procs), None
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            _stop(running)
            return -1, f"\nstopped: no exit within {timeout} s\n"
        for sentinel in wait([p.sentinel for p in running], timeout=left):
            proc = next(p for p in running if p.sentinel == sentinel)
            proc.join()
            running.remove(proc)
            if proc.exitcode != 0 and failed is None:
                failed = proc
                _stop(running)
    if len(procs) == 1:
        return procs[0].exitcode, ""
    return (0, "") if failed is None else (1, f"\nrank {procs.index(failed)} exited with "
                                              f"{failed.exitcode}\n")


def _stop(procs: List) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join(STOP_GRACE_S)
        if proc.exitcode is None:
            proc.kill()
            proc.join()


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:  # a child killed before it opened its files
        return ""


def _child(target: Target, cwd: str, env: dict, out: str, err: str) -> None:
    """In the forked process: the start-up a cold `python` would have had, then `target`; it exits
    with the code the interpreter would exit with, its exit handlers run, but without finalisation
    (where gloo's threads can abort it) and without waiting on its peers to destroy a process
    group (a failing rank leaves at once; `tandem`'s own ranks destroy theirs)."""
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _start_up(env)
    kind, name, args = target
    exit_without_finalisation(exit_code_of(lambda: _run_target(kind, name, list(args))))


def _start_up(env: dict) -> None:
    """What Python's start-up takes from the environment, done in the forked process."""
    new = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = new  # after the script's directory, ahead of site-packages, as Python has it
    if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in new):
        import sitecustomize  # noqa: F401 - imported for its effect, as Python's start-up does
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
        native_stacks_on_fatal_signal()
    for option in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        if ":" in option:
            raise ValueError(f"PYTHONWARNINGS={option!r}: only a bare action is handled here")
        warnings.simplefilter(option)
    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def native_stacks_on_fatal_signal() -> None:
    """torch's own fatal-signal handler (c10::FatalSignalHandler) on top of faulthandler's: on
    SIGSEGV, SIGABRT, SIGBUS, SIGILL or SIGFPE it prints every thread's native stack to stderr
    (the faulting thread's passes through its handler), then calls the handler it replaced
    (faulthandler, which prints the Python stacks and lets the signal kill). faulthandler alone
    shows where the Python code was, not which library faulted nor on which thread: a gloo
    thread's crash then looks like one in whatever the main thread was computing. Called again
    after faulthandler is re-enabled (which puts its own handler back on top)."""
    torch._C._set_print_stack_traces_on_fatal_signal(False)
    torch._C._set_print_stack_traces_on_fatal_signal(True)


def _run_target(kind: str, name, args: List) -> Optional[int]:
    if kind == "tandem":
        sys.argv = [shutil.which("tandem") or "tandem", *args]
        return tandem_main()
    # sys.path[0] as Python sets it: the working directory for -m and -c, the script's directory
    if kind == "module":
        sys.argv = [name, *args]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(name, run_name="__main__", alter_sys=True)
        return 0
    if kind == "code":
        sys.argv = ["-c", *args]
        sys.path.insert(0, "")
        exec(compile(name, "<string>", "exec"), {"__name__": "__main__"})
        return 0
    if kind == "function":  # leaves as a rank of `tandem` does (`run_as_process`)
        return run_as_process(lambda: name(*args))
    if kind == "script":
        sys.argv = [name, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
        runpy.run_path(name, run_name="__main__")
        return 0
    raise ValueError(f"unknown target kind {kind!r}")
