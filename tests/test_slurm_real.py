"""examples/pretrain_gpt.slurm under a real Slurm: the test starts its own one-node cluster
(munged with its own key, slurmctld and slurmd, a private slurm.conf in a temporary
directory, 2 CPUs), submits the script with sbatch, scaled down to a tiny GPT on 2 CPU ranks
(gloo, mock data), and stops everything it started, also when a test fails.

- An uninterrupted job trains to the end.
- The time-limit path: the signal that ``#SBATCH --signal=B:USR1@300`` sends 300 s before
  the time limit (USR1 to the batch shell alone, as ``scancel --batch --signal=USR1`` sends
  it), after which the script passes SIGTERM to the ranks, they save
  (``--exit-signal-handler``), and the script requeues the job.
- A preemption: ``scontrol requeue``, Slurm's own stop and requeue (SIGTERM to every process
  of the job, KillWait, back in the queue), as ``PreemptMode=REQUEUE`` does.

Each stopped job is requeued, runs the script again, resumes from its checkpoint (--load),
and its log (appended to: ``--open-mode=append``) has the uninterrupted job's lm loss at
every iteration.

Runs where Slurm is installed (Debian: ``apt-get install slurmctld slurmd slurm-client
munge``), as root, on a host whose name resolves; skips elsewhere with the reason, and
also where the daemons do not come up (with their logs). The stand-in test,
tests/test_slurm_example.py, runs everywhere."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.slurm")
ITERS = 60           # enough that a signal sent at iteration 3 lands well before the end
SIGNAL_AT = 3        # the iteration after which a job is stopped
JOB_TIMEOUT_S = 150  # for one job, requeue included
KILL_WAIT_S = 15     # slurm.conf KillWait: a preempted job's time to save
SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")

# What the test changes in the script: the resources (one node, 2 CPUs, no GPU) and the
# model flags. The rest (MASTER_ADDR, --load on a requeue, the traps, srun and torchrun)
# runs as written. --num-workers stays at its default (2 DataLoader worker processes per
# rank, which Slurm's SIGTERM reaches too).
TINY_ARGS = f"""PRETRAIN_ARGS=(
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32
    --micro-batch-size 2 --global-batch-size 8 --train-iters {ITERS}
    --hidden-dropout 0 --attention-dropout 0 --deterministic-mode --device cpu
    --snake-offload --snake-offload-dir "$NVME/{{node}}/{{local_rank}}"
    --log-interval 1 --save "$CKPT" --save-interval 1000
    --exit-signal-handler
)"""
KEPT_FLAGS = ('--snake-offload-dir "$NVME/{node}/{local_rank}"', '--save "$CKPT"',
              "--exit-signal-handler")


def _which(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN}")


def _why_not() -> str | None:
    missing = [c for c in COMMANDS if _which(c) is None]
    if missing:
        return (f"needs Slurm and MUNGE: {', '.join(missing)} not found "
                "(Debian: apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        return ("needs root: the test's slurmd runs as SlurmdUser=root and its munged "
                "must own its key")
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError as e:
        return (f"the host name {host!r} does not resolve ({e}): the batch script's "
                "MASTER_ADDR is the first node's name")
    return None


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def scaled_script(text: str) -> str:
    """The batch script with one node of 2 CPUs and the tiny GPT's flags."""
    block = re.search(r"^PRETRAIN_ARGS=\(\n.*?^\)$", text, re.M | re.S)
    assert block, "no PRETRAIN_ARGS=( ... ) block in the script"
    for flag in KEPT_FLAGS:
        assert flag in block.group(0), f"the script no longer passes {flag}"
    for pattern, new in [(r"^#SBATCH --nodes=\d+$", "#SBATCH --nodes=1"),
                         (r"^#SBATCH --gpus-per-node=\d+\n", ""),
                         (r"^#SBATCH --cpus-per-task=\d+$", "#SBATCH --cpus-per-task=2"),
                         (r"^GPUS_PER_NODE=\d+ ", "GPUS_PER_NODE=2 "),
                         (r"^PRETRAIN_ARGS=\(\n.*?^\)$", TINY_ARGS)]:
        text, n = re.subn(pattern, lambda _: new, text, flags=re.M | re.S)
        assert n == 1, f"{pattern!r} matched {n} times in the script"
    return text


class Cluster:
    """munged, slurmctld and slurmd of a one-node cluster, all under ``base``."""

    def __init__(self, base: str):
        self.base = base
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(base, "slurm.conf")
        self.procs: dict[str, subprocess.Popen] = {}
        for d in ("munge", "state", "spool", "log", "shared", "nvme", "tmp"):
            os.mkdir(os.path.join(base, d), 0o755)
        key = os.path.join(base, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        self.socket = os.path.join(base, "munge", "socket")
        # job ids, and with them the script's MASTER_PORT (29500 + id % 1000), not in use
        first = next(j for j in (random.randrange(1000, 1_000_000, 10) for _ in range(100))
                     if all(_port_free(29500 + (j + k) % 1000) for k in range(5)))
        with open(self.conf, "w") as f:
            f.write(f"""\
ClusterName=snaketest
SlurmctldHost={self.host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it starts again (120 s by default)
AuthInfo=socket={self.socket},cred_expire=5
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobRequeue=1
FirstJobId={first}
KillWait={KILL_WAIT_S}
MinJobAge=600
InactiveLimit=0
ReturnToService=2
NodeName={self.host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")
        # Slurm's client commands and the jobs see this configuration only
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        # the job's torchrun and python: this interpreter's
        self.env.update(SLURM_CONF=self.conf, PATH=os.pathsep.join(
            [os.path.dirname(sys.executable), self.env.get("PATH", ""), SBIN]))
        self.env.pop("MASTER_PORT", None)
        self.env.pop("MASTER_ADDR", None)

    def _start(self, name: str, *argv: str) -> None:
        log = open(os.path.join(self.base, "log", f"{name}.out"), "w")
        self.procs[name] = subprocess.Popen([_which(name), *argv], env=self.env,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        log.close()

    def logs(self) -> str:
        out = []
        for name in ("munged.out", "slurmctld.out", "slurmd.out", "slurmctld.log",
                     "slurmd.log"):
            path = os.path.join(self.base, "log", name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"--- {name}\n" + "".join(f.readlines()[-25:]))
        return "\n".join(out)

    def start(self) -> None:
        m = os.path.join(self.base, "munge")
        self._start("munged", "-F", f"--key-file={m}/munge.key", f"--socket={self.socket}",
                    f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed",
                    f"--log-file={m}/munged.log")
        self._wait(lambda: os.path.exists(self.socket), 20, "munged's socket")
        self._start("slurmctld", "-D", "-i")
        self._start("slurmd", "-D")
        self._wait(lambda: self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
                   == "idle", 60, "the node to be idle")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    pytest.skip(f"Slurm cannot run here: {name} exited with status "
                                f"{proc.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                pytest.skip(f"Slurm cannot run here: no {what} after {timeout} s\n"
                            f"{self.logs()}")
            time.sleep(0.2)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if check:
            assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stderr}"
        return proc

    def sbatch(self, script: str, name: str) -> tuple[int, str]:
        """Submit ``script`` from the repository root; its job id and log path."""
        out = os.path.join(self.base, f"{name}-%j.out")
        job = int(self.run("sbatch", "--parsable", f"--chdir={ROOT}", f"--output={out}",
                           f"--job-name={name}", script).stdout.strip().split(";")[0])
        return job, out.replace("%j", str(job))

    def job(self, job: int) -> dict[str, str]:
        line = self.run("scontrol", "-o", "show", "job", str(job)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_until_done(self, job: int, log: str) -> dict[str, str]:
        """The job's record once it has ended (a requeued job is pending, not ended)."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            info = self.job(job)
            if info["JobState"] in ENDED:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job} not done in {JOB_TIMEOUT_S} s: {self.job(job)}\n"
                             f"{_read(log)[-3000:]}\n{self.logs()}")

    def stop(self) -> None:
        """Cancel every job, stop the daemons; then kill whatever is left that runs with
        this cluster's configuration (slurmstepd outlives slurmd)."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + KILL_WAIT_S + 10
                while self.run("squeue", "-h", check=False).stdout.strip() and \
                        time.monotonic() < deadline:
                    time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftovers(self) -> list[int]:
        """Processes that have this cluster's SLURM_CONF in their environment."""
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if mark in f.read().split(b"\0"):
                            pids.append(int(entry))
                except OSError:
                    pass
        return pids


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _summary(log: str) -> str:
    """The log without its iteration lines, which say where they were left out."""
    out, skipped = [], 0
    for line in log.splitlines():
        if re.search(r"iteration +\d+/", line):
            skipped += 1
            continue
        if skipped:
            out.append(f"[{skipped} iteration lines]")
            skipped = 0
        out.append(line[:300])
    if skipped:
        out.append(f"[{skipped} iteration lines]")
    return "\n".join(out[-150:])


def _losses(log: str) -> dict[int, float]:
    """Iteration -> lm loss; an iteration logged twice fails the test."""
    seen: dict[int, float] = {}
    for it, loss in re.findall(r"iteration +(\d+)/ *\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|",
                               log):
        assert int(it) not in seen, f"iteration {it} logged twice"
        seen[int(it)] = float(loss)
    return seen


@pytest.fixture(scope="module")
def cluster():
    base = tempfile.mkdtemp(prefix="snake-slurm-", dir="/tmp")
    os.chmod(base, 0o755)   # munged: every directory above its socket searchable by all
    c = None
    try:
        c = Cluster(base)
        c.start()
        with open(SCRIPT) as f:
            c.script = os.path.join(base, "pretrain_gpt.slurm")
            with open(c.script, "w") as out:
                out.write(scaled_script(f.read()))
        yield c
    finally:
        left = []
        if c is not None:
            c.stop()
            left = c.leftovers()
        shutil.rmtree(base, ignore_errors=True)
        assert not left, f"processes left running: {left}"


def _submit(cluster: Cluster, name: str) -> tuple[int, str]:
    """The scaled script with its own checkpoint and offload directories."""
    env_shared = os.path.join(cluster.base, "shared", name)
    env_nvme = os.path.join(cluster.base, "nvme", name)
    cluster.env.update(SHARED=env_shared, NVME=env_nvme, PYTHONUNBUFFERED="1",
                       OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                       TMPDIR=os.path.join(cluster.base, "tmp"),
                       PYTHONPATH=os.pathsep.join(
                           p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return cluster.sbatch(cluster.script, name)


@pytest.fixture(scope="module")
def uninterrupted(cluster):
    job, log = _submit(cluster, "whole")
    info = cluster.wait_until_done(job, log)
    text = _read(log)
    assert info["JobState"] == "COMPLETED", f"{info}\n{_summary(text)}\n{cluster.logs()}"
    print(f"job {job} (whole): {ITERS} iterations, not stopped")
    return job, text, _losses(text)


def test_the_script_trains_two_ranks_under_slurm(cluster, uninterrupted):
    job, text, losses = uninterrupted
    assert sorted(losses) == list(range(1, ITERS + 1)), text[-3000:]
    assert "data-parallel shard 1/2" in text       # two ranks, one per CPU
    assert f"> saved checkpoint at iteration {ITERS}" in text
    ckpt = os.path.join(cluster.base, "shared", "whole", "checkpoints")
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(ITERS)
    assert cluster.job(job)["Restarts"] == "0"


def _stop_and_resume(cluster: Cluster, uninterrupted, name: str, stop) -> str:
    """Submit, call ``stop(job)`` once iteration SIGNAL_AT is logged, wait for the requeued
    job to finish; check that it saved, resumed and matched the uninterrupted losses."""
    job, log = _submit(cluster, name)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not re.search(rf"iteration +{SIGNAL_AT}/", _read(log)):
        assert time.monotonic() < deadline, f"{cluster.job(job)}\n{_read(log)[-3000:]}"
        assert cluster.job(job)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), \
            f"{cluster.job(job)}\n{_read(log)[-3000:]}\n{cluster.logs()}"
        time.sleep(0.1)
    stop(job)
    info = cluster.wait_until_done(job, log)
    text = _read(log)
    context = f"{info}\n{_summary(text)}\n{cluster.logs()}"
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", context
    if re.search(r"DataLoader worker \(pid.*(killed by signal: Terminated|exited unexpectedly)",
                 text):
        pytest.fail(
            "the SIGTERM killed the ranks' DataLoader worker processes (--num-workers > 0), "
            "and the ranks died with them before saving: Slurm signals every process of the "
            "job, and torchrun passes the signal on with os.killpg, which reaches the workers "
            "too. The workers must ignore SIGTERM (a DataLoader worker_init_fn in "
            f"megatron_snake/training/data.py) and leave the stop to their rank.\n{context}")
    saved = re.findall(r"> exiting at iteration (\d+): SIGTERM received", text)
    assert len(saved) == 1, context
    saved = int(saved[0])
    assert SIGNAL_AT <= saved < ITERS, context
    assert f"> saved checkpoint at iteration {saved} " in text, context
    assert f"> loaded checkpoint from {cluster.env['SHARED']}/checkpoints at iteration " \
           f"{saved}" in text, context
    # the same lm loss at every iteration, before the stop and after the resume
    assert _losses(text) == uninterrupted[2], context
    print(f"job {job} ({name}): saved at iteration {saved}, requeued, resumed; lm loss of "
          f"iterations 1-{ITERS} equal to job {uninterrupted[0]}'s, e.g. "
          f"{saved}: {uninterrupted[2][saved]:.6E}, {saved + 1}: "
          f"{uninterrupted[2][saved + 1]:.6E}")
    return text


def test_time_limit_signal_saves_requeues_and_resumes_exactly(cluster, uninterrupted):
    """The script's own path: USR1 to the batch shell (what --signal=B:USR1@300 sends),
    SIGTERM to the ranks, a save, ``scontrol requeue`` from the script."""
    text = _stop_and_resume(
        cluster, uninterrupted, "timelimit",
        lambda job: cluster.run("scancel", "--batch", "--signal=USR1", str(job)))
    assert "USR1: the time limit is near" in text
    assert re.search(r"requeueing job \d+ \(srun exited with \d+\)", text)


def test_preemption_saves_requeues_and_resumes_exactly(cluster, uninterrupted):
    """Slurm's own stop and requeue (as for PreemptMode=REQUEUE): SIGTERM to every process
    of the job, KillWait for the save, the job back in the queue."""
    text = _stop_and_resume(cluster, uninterrupted, "preempted",
                            lambda job: cluster.run("scontrol", "requeue", str(job)))
    assert "DUE TO JOB REQUEUE" in text
    assert "SIGTERM: Slurm is stopping the job" in text
