"""examples/pretrain_gpt.slurm: bash accepts it, and what it launches is right. The script
runs here with stand-ins for srun, scontrol and torchrun; each node's torchrun arguments
are checked, and the pretrain_gpt.py flags go through parse_args for the job's world size
(the script's nodes x GPUs per node). The preemption traps run against stand-ins too;
tests/test_slurm_real.py runs the script under a real, local Slurm."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from megatron_snake.training.arguments import parse_args
from megatron_snake.training.offloaded_state import offload_dirs_for_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.slurm")
JOB_ID = 4321

STUBS = {
    # the job's node names, one a line
    "scontrol": 'for ((n = 0; n < SLURM_NNODES; n++)); do echo "node$n"; done\n',
    # srun's own options, then one task per node
    "srun": 'while [[ $1 == --* ]]; do shift; done\n'
            'for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@" || exit; done\n',
    # what each node's torchrun was given, NUL-separated
    "torchrun": 'printf "%s\\0" "$@" > "$OUT/torchrun.$SLURM_NODEID"\n',
}


def _sbatch(option: str) -> int:
    with open(SCRIPT) as f:
        return int(re.search(rf"^#SBATCH --{option}=(\d+)", f.read(), re.M).group(1))


def _env(tmp_path, **stubs) -> dict:
    """The batch script's environment on a job of its own size, with the stand-ins
    (``stubs`` replace them) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in {**STUBS, **stubs}.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    nodes = _sbatch("nodes")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path),
               SLURM_JOB_NODELIST=f"node[0-{nodes - 1}]", SLURM_NNODES=str(nodes),
               SLURM_JOB_ID=str(JOB_ID), SLURM_CPUS_PER_TASK=str(_sbatch("cpus-per-task")),
               SHARED=str(tmp_path / "shared"), NVME=str(tmp_path / "nvme"), USER="me")
    env.pop("MASTER_PORT", None)
    return env


def _launch(tmp_path, **stubs) -> dict[int, list[str]]:
    """Run the batch script as Slurm would; each node's torchrun arguments."""
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=_env(tmp_path, **stubs),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {n: (tmp_path / f"torchrun.{n}").read_text().split("\0")[:-1]
            for n in range(_sbatch("nodes"))}


def test_slurm_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_slurm_script_launches_one_torchrun_per_node_with_flags_that_parse(
        tmp_path, monkeypatch):
    nodes, gpus = _sbatch("nodes"), _sbatch("gpus-per-node")
    assert _sbatch("ntasks-per-node") == 1  # torchrun starts the ranks, not srun
    launched = _launch(tmp_path)
    for node, argv in launched.items():
        split = argv.index("examples/pretrain_gpt.py")
        torchrun, flags = argv[:split], argv[split + 1:]
        assert dict(zip(torchrun[::2], torchrun[1::2])) == {
            "--nnodes": str(nodes), "--node-rank": str(node), "--nproc-per-node": str(gpus),
            "--master-addr": "node0", "--master-port": str(29500 + JOB_ID % 1000)}
        assert flags == launched[0][launched[0].index("examples/pretrain_gpt.py") + 1:]
        args = parse_args(flags, world_size=nodes * gpus)
        assert args.tensor_model_parallel_size * args.pipeline_model_parallel_size * \
            args.data_parallel_size == nodes * gpus
        assert args.snake_offload and args.load is None
        assert args.save == str(tmp_path / "shared" / "checkpoints")
        # every rank of this node finds its own, existing offload directory
        monkeypatch.setenv("GROUP_RANK", str(node))
        dirs = set()
        for local_rank in range(gpus):
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
            path, = offload_dirs_for_rank(args.snake_offload_dir, node * gpus + local_rank)
            assert path == str(tmp_path / "nvme" / str(node) / str(local_rank))
            assert os.path.isdir(path)
            dirs.add(path)
        assert len(dirs) == gpus

    # resubmitted after a save: it goes on from the checkpoint
    ckpt = tmp_path / "shared" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("500")
    flags = _launch(tmp_path)[0]
    args = parse_args(flags[flags.index("examples/pretrain_gpt.py") + 1:],
                      world_size=nodes * gpus)
    assert args.load == str(ckpt)


def test_a_long_node_list_does_not_stop_the_script(tmp_path):
    """The first host name is taken without closing the pipe early: under pipefail,
    ``scontrol ... | head -n1`` died of SIGPIPE (status 141) when the list was long."""
    long_list = 'for ((n = 0; n < 20000; n++)); do echo "node$n"; done\n'
    launched = _launch(tmp_path, scontrol=long_list)
    assert launched[0][launched[0].index("--master-addr") + 1] == "node0"


# The job's steps until they are stopped: srun waits for scancel (the ranks' SIGTERM), then
# exits 1, as torchrun does after a SIGTERM even when its ranks saved and left.
PREEMPTION_STUBS = {
    "srun": 'touch "$OUT/started"\n'
            'while [ ! -e "$OUT/stopped" ]; do sleep 0.05; done\nexit 1\n',
    "scancel": 'echo "scancel $*" >> "$OUT/calls"; touch "$OUT/stopped"\n',
    "scontrol": 'if [ "$1" = requeue ]; then echo "scontrol $*" >> "$OUT/calls"\n'
                'else echo node0; echo node1; fi\n',
}


def _signalled(tmp_path, sig) -> tuple[int, list[str], str]:
    """Start the script, send ``sig`` to it (the batch shell alone) once srun runs; its exit
    status, the scancel and scontrol requeue calls it made, its output."""
    proc = subprocess.Popen(["bash", SCRIPT], cwd=ROOT,
                            env=_env(tmp_path, **PREEMPTION_STUBS),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(sig)
    if sig != signal.SIGUSR1:      # Slurm stops the steps itself
        time.sleep(0.3)
        (tmp_path / "stopped").touch()
    out = proc.communicate(timeout=30)[0]
    calls = tmp_path / "calls"
    return proc.returncode, calls.read_text().splitlines() if calls.exists() else [], out


def test_the_time_limit_signal_stops_the_steps_then_requeues(tmp_path):
    """--signal=B:USR1@300: USR1 reaches the batch shell alone. The script sends SIGTERM to
    the steps (scancel, not to srun, which would kill its tasks), waits for srun and
    requeues the job. tests/test_slurm_real.py runs it under a real Slurm."""
    assert "#SBATCH --signal=B:USR1@" in open(SCRIPT).read()
    assert re.search(r"^#SBATCH --requeue$", open(SCRIPT).read(), re.M)
    code, calls, out = _signalled(tmp_path, signal.SIGUSR1)
    assert code == 0, out
    assert calls == [f"scancel --signal=TERM {JOB_ID}", f"scontrol requeue {JOB_ID}"], out
    assert f"requeueing job {JOB_ID} (srun exited with 1)" in out


def test_a_preemption_leaves_the_requeue_to_slurm(tmp_path):
    """SIGTERM reaches every process of the job (scontrol requeue, PreemptMode=REQUEUE, or
    scancel): the script waits for srun, requeues nothing and exits with srun's status."""
    code, calls, out = _signalled(tmp_path, signal.SIGTERM)
    assert code == 1, out
    assert calls == [], out
    assert "SIGTERM: Slurm is stopping the job" in out
