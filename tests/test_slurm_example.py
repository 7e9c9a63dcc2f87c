"""examples/pretrain_gpt.slurm: bash accepts it, and what it launches is right. The script
runs here with stand-ins for srun, scontrol and torchrun; each node's torchrun arguments
are checked, and the pretrain_gpt.py flags go through parse_args for the job's world size
(the script's nodes x GPUs per node)."""

from __future__ import annotations

import os
import re
import subprocess

from megatron_snake.training.arguments import parse_args
from megatron_snake.training.offloaded_state import offload_dir_for_rank

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


def _launch(tmp_path, **stubs) -> dict[int, list[str]]:
    """Run the batch script as Slurm would on a job of its own size (``stubs`` replace
    stand-ins); each node's torchrun arguments."""
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
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {n: (tmp_path / f"torchrun.{n}").read_text().split("\0")[:-1]
            for n in range(nodes)}


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
            path = offload_dir_for_rank(args.snake_offload_dir, node * gpus + local_rank)
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
