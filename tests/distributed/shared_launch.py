"""Several workers of this package in one launch per world size.

Starting a launch costs more than most of the checks it runs: every rank importing torch and the
trainer (measured on the suite's 2 cores, under torchrun: 7 s for 2 ranks, 11 s for 4, 18 s for 8,
most of it CPU that the other xdist worker then lacks; tests/processes.py forks the ranks from a
warm interpreter instead), then forming the gloo group and its meshes. So the
test modules of tests/distributed that need nothing prepared before their launch declare their
workers' jobs (`SHARED_JOBS`, and the training-equivalence tables of tests/conftest.py), and one
launch per world size runs them all in turn (`launch`), each writing into its test module's
directory.

Each job is a worker module's `main(argv)` with argv[0] its output directory. The group is formed
once, here: a worker's own `dist.init_process_group` finds it formed and its
`dist.destroy_process_group` leaves it (a group destroyed and formed again in one launch hangs
under a shared store). Device meshes are built once per shape for the whole launch
(`worker.reuse_device_meshes`). A job's stdout goes to `stdout.<worker>.rank<r>` in its directory.
After a job every rank writes `<worker>.w<world>.rank<r>.done`, or `.error` with the traceback
(the launch then stops: the other ranks would wait in a collective that never comes), so each test
module checks its own jobs (`check`) and a failure is reported by the module that caused it. A rank
that died of a signal left neither marker: its jobs' reports carry the launch's output, where
faulthandler wrote its stack. Nothing is retried: a crash fails its tests."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Dict, List, Tuple

from tests import processes
from tests.distributed import worker

TIMEOUT_S = 1800
"""One launch runs many jobs (the 2-rank launch about five minutes of them on 2 busy cores)."""


NATIVE_STACK = re.compile(r"SIG[A-Z]+\(\d+\), PID: \d+, Thread \d+:")
"""The header of each thread's native stack that torch prints when a rank dies of a signal
(tests/processes.native_stacks_on_fatal_signal)."""


def dead_rank_stacks(output: str) -> str:
    """From a launch's output: the faulting thread's native stack (the one whose frames pass
    through torch's fatal-signal handler; the other threads' were asked for with SIGUSR2) and
    faulthandler's Python stacks (absent when the job writes them to a file of its own, as
    eval_worker does); empty if no rank died of a signal."""
    parts = []
    starts = [m.start() for m in NATIVE_STACK.finditer(output)]
    blocks = [output[a:b] for a, b in zip(starts, starts[1:] + [len(output)])]
    faulting = [b for b in blocks if "FatalSignalHandler::fatalSignalHandler" in b] or blocks
    if faulting:
        parts.append(faulting[0][:3000])
    python = output.find("Fatal Python error")
    if python >= 0:
        parts.append(output[python:python + 4000])
    return "\n".join(parts)


def exit_note(proc: subprocess.CompletedProcess) -> str:
    """The launcher's last word on a failed launch (`rank R exited with CODE`), with the signal's
    name when a signal ended that rank."""
    lines = proc.stderr.strip().splitlines()
    note = lines[-1] if lines else f"exit code {proc.returncode}"
    code = note.rsplit(" ", 1)[-1]
    if code.startswith("-") and code[1:].isdigit():
        note += f" ({signal.Signals(-int(code)).name})"
    return note


def marker(directory, module: str, world: int, rank: int, kind: str) -> Path:
    return Path(directory) / f"{module.rsplit('.', 1)[-1]}.w{world}.rank{rank}.{kind}"


def launch(world: int, jobs: List[Tuple[Path, str, List[str]]], spec_dir: Path
           ) -> subprocess.CompletedProcess:
    """Run `jobs` ((output directory, worker module, arguments)) in order in one launch of `world`
    ranks; the caller reads each job's markers (`check`)."""
    spec = spec_dir / f"jobs.w{world}.json"
    spec.write_text(json.dumps([{"dir": str(d), "module": m, "args": [str(a) for a in args]}
                                for d, m, args in jobs]))
    return processes.command([sys.executable, "-m", __name__, spec], world, timeout=TIMEOUT_S)


def check(directory, module: str, world: int, proc: subprocess.CompletedProcess) -> None:
    """Assert that `module`'s job of the `world`-rank launch finished on every rank; else its
    ranks' tracebacks, or (it never ran: an earlier job stopped the launch) the launch's output."""
    done = [marker(directory, module, world, r, "done").exists() for r in range(world)]
    if all(done):
        return
    errors = [marker(directory, module, world, r, "error") for r in range(world)]
    report = [f"--- rank {r} ---\n{e.read_text()[-4000:]}" for r, e in enumerate(errors)
              if e.exists()]
    if any(not d and not e.exists() for d, e in zip(done, errors)):
        # a rank with neither marker died (a signal) or never reached this job; the others'
        # tracebacks are then only the echo of it. A dead rank's stacks are in the launch's errors
        # (torch's native ones, the faulting thread first, then faulthandler's Python ones unless
        # the job sends those to a file of its own), ahead of the other ranks' tracebacks: shown
        # last, and the launch's exit note last of all
        output = proc.stdout + proc.stderr
        stacks = dead_rank_stacks(output)
        report += [f"{module} did not run to its end on every rank of the {world}-rank launch "
                   f"(exit code {proc.returncode}):", stacks or output[-8000:],
                   f"{module}, {world}-rank launch: {exit_note(proc)}"]
    raise AssertionError("\n".join(report))


class SharedLaunches:
    """The session's shared launches (tests/conftest.py `shared_launches`): which test module's
    jobs ran in which launch, and where each module's directory is."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs: Dict[str, List[Tuple[int, str]]] = {}
        self.procs: Dict[int, subprocess.CompletedProcess] = {}

    def run(self, by_world: Dict[int, List[Tuple[str, str, List[str]]]]) -> None:
        """One launch per world size, smallest first, of its (test module, worker, args) jobs."""
        for world in sorted(by_world):
            jobs = [(self.dir(name), module, args) for name, module, args in by_world[world]]
            self.procs[world] = launch(world, jobs, self.root)
            for name, module, _ in by_world[world]:
                self.jobs.setdefault(name, []).append((world, module))

    def dir(self, name: str) -> Path:
        return self.root / name

    def check(self, name: str, world: int | None = None) -> Path:
        """Assert that test module `name`'s jobs (of the `world`-rank launch only, when given) ran
        to their end; returns the module's directory."""
        for job_world, module in self.jobs.get(name, []):
            if world in (None, job_world):
                check(self.dir(name), module, job_world, self.procs[job_world])
        return self.dir(name)


def main(argv: List[str]) -> int:
    import torch.distributed as dist

    jobs: List[Dict] = json.loads(Path(argv[0]).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    form, destroy = dist.init_process_group, dist.destroy_process_group

    def keep_formed(*args, **kwargs):
        if not dist.is_initialized():
            form(*args, **kwargs)

    def keep_default(group=None):
        if group is not None:
            destroy(group)

    dist.init_process_group, dist.destroy_process_group = keep_formed, keep_default
    worker.reuse_device_meshes()  # one mesh per shape for every job, as a run builds one
    for job in jobs:
        module = job["module"]
        os.makedirs(job["dir"], exist_ok=True)
        out = Path(job["dir"]) / f"stdout.{module.rsplit('.', 1)[-1]}.rank{rank}"
        try:
            with open(out, "w") as f, contextlib.redirect_stdout(f):
                code = importlib.import_module(module).main([job["dir"], *job["args"]])
            if code:
                raise RuntimeError(f"{module} returned {code}")
        except BaseException:
            marker(job["dir"], module, world, rank, "error").write_text(traceback.format_exc())
            raise
        marker(job["dir"], module, world, rank, "done").touch()
        dist.barrier()  # every rank done with a job before the next starts
    destroy()
    return 0


if __name__ == "__main__":
    processes.finish(lambda: main(sys.argv[1:]))
