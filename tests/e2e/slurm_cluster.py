"""A throwaway one-node Slurm cluster on localhost for the e2e tests.

`SlurmCluster` installs Slurm and munge from Debian when `slurmctld` is absent (`apt-get install
slurm-wlm munge`, needs root), then runs everything from one temporary directory so that nothing in
/etc or /var is used or changed:

- munged with its own key, socket, pid, seed and log files (`AuthInfo=socket=...` points Slurm at
  it);
- slurm.conf for one node named after `hostname -s` with the real CPU count and memory,
  `ProctrackType=proctrack/linuxproc` and `TaskPlugin=task/none` (no cgroups, no systemd: this works
  inside containers and gVisor), no accounting daemon, state and spool dirs under the temp dir;
- slurmctld and slurmd in the foreground (`-D`) as child processes of this one.

`env` is what client commands need (`SLURM_CONF`); `start()` waits until `sinfo` reports the node
idle. `stop()` terminates exactly the daemons it started, by pid (and their process groups, which
they lead).

Run it by hand with `python tests/e2e/slurm_cluster.py` (starts, prints `export SLURM_CONF=...`,
waits for Ctrl-C, stops).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

APT_PACKAGES = ["slurm-wlm", "munge"]


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here (no root or no apt)."""


def ensure_slurm_installed() -> None:
    """Install slurm-wlm and munge from Debian when slurmctld is missing. Raises
    SlurmUnavailable."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmctld is not installed and this is not root (cannot apt-get "
                               "install)")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("slurmctld is not installed and apt-get is not available")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *APT_PACKAGES]
    if subprocess.run(install, env=env, capture_output=True, text=True).returncode != 0:
        update = subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
        res = subprocess.run(install, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            tail = (update.stderr + res.stderr).strip().splitlines()[-3:]
            raise SlurmUnavailable(f"apt-get install {' '.join(APT_PACKAGES)} failed: "
                                   f"{' | '.join(tail)}")
    if not shutil.which("slurmctld"):
        raise SlurmUnavailable("slurmctld still missing after apt-get install")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


class SlurmCluster:
    """One-node Slurm on localhost in a temp dir. Use as a context manager or start()/stop()."""

    def __init__(self, root: Optional[str] = None):
        self.root = Path(root or tempfile.mkdtemp(prefix="tandem-slurm-"))
        self.host = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        # Leave a little headroom: slurmd drains a node whose configured memory exceeds what it
        # sees.
        self.memory_mb = max(256, int(_real_memory_mb() * 0.9))
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._procs: List[subprocess.Popen] = []
        self._logs: List = []

    # -- environment for client commands ---------------------------------------------------------
    @property
    def env(self) -> Dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def full_env(self) -> Dict[str, str]:
        return dict(os.environ, **self.env)

    def run(self, *argv: str, check: bool = True,
            timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.full_env(), capture_output=True, text=True,
                              check=check, timeout=timeout)

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        ensure_slurm_installed()
        try:
            self._write_files()
            self._start_munged()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._wait_for(lambda: self.run("scontrol", "ping", check=False).stdout.count("UP") > 0,
                           timeout, "slurmctld")
            self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
            self._wait_for(self._node_idle, timeout, "slurmd (node idle in sinfo)")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop exactly the daemons this object started, newest first, by pid."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def logs(self) -> str:
        """Tail of every daemon log (for assertion messages)."""
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log", "slurmctld.stdout",
                     "slurmd.stdout", "munged.stdout"):
            p = self.root / "log" / name
            if p.exists():
                out.append(f"--- {name}\n"
                           + "\n".join(p.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(out)

    # -- internals ---------------------------------------------------------------------------------
    def _node_idle(self) -> bool:
        res = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return res.returncode == 0 and res.stdout.strip().startswith("idle")

    def _wait_for(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} while "
                                       "waiting for "
                                       f"{what}\n{self.logs()}")
            if pred():
                return
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def _spawn(self, name: str, argv: List[str]) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.stdout", "ab")
        self._logs.append(log)
        # Own session: the daemon and anything it forks stay out of pytest's process group.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.full_env(),
                                start_new_session=True)
        self._procs.append(proc)
        return proc

    def _start_munged(self) -> None:
        mdir = self.root / "munge"
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            [
                "munged", "--foreground", "--force",
                f"--socket={self.munge_socket}", f"--key-file={key}",
                f"--pid-file={mdir / 'munged.pid'}", f"--seed-file={mdir / 'munged.seed'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
            ],
        )
        self._wait_for(self.munge_socket.exists, 20, "munged socket")

    def _write_files(self) -> None:
        for sub in ("etc", "munge", "log", "state", f"spool/slurmd-{self.host}", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # clients need to reach the socket; the key itself is 0400
        (self.root / "munge").chmod(0o755)
        r = self.root
        ctld_port, slurmd_port = _free_port(), _free_port()
        conf = f"""\
# Generated by tests/e2e/slurm_cluster.py: one node on localhost, no cgroups, no accounting daemon.
ClusterName=tandem-e2e
SlurmctldHost={self.host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays the restart of a requeued job (default 120 s).
AuthInfo=socket={self.munge_socket},cred_expire=10
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/slurmd-%n
SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}
SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups and no systemd in a container: track processes through /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
# Use the node description below even where the container reports the hardware differently.
SlurmdParameters=config_overrides
KillWait=10
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
SlurmctldTimeout=60
MessageTimeout=20
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory={self.memory_mb} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        self.conf.write_text(conf)


def main() -> None:  # manual use
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    cluster = SlurmCluster()
    cluster.start()
    print(f"export SLURM_CONF={cluster.conf}", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
