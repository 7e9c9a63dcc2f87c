"""A model built out of memory: each decoder layer's values go to the store as soon as
Megatron-Core initialises them. The initial weights must be bit-identical to Megatron's own
in-memory build (same seed and flags), tied and untied, and per rank under TP = 2; and the
process that builds and trains a model must hold a small fraction of its training state
(peak RSS from the OS)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
VOCAB = 384


def _initial_weights_match(flags, tmp_dir) -> list[str]:
    """Names whose streamed initial value differs from Megatron's in-memory build."""
    from megatron_snake.models.gpt_units import unwrap_model
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.build import build_run
    from megatron_snake.training.distributed import set_seed
    from megatron_snake.training.model import build_gpt_model

    args = parse_args(flags)
    device = torch.device("cpu")
    set_seed(args.seed)
    reference = {k: v.clone() if torch.is_tensor(v) else v
                 for k, v in build_gpt_model(args, VOCAB, device).state_dict().items()}
    set_seed(args.seed)
    offloaded = parse_args([*flags, "--snake-offload", "--snake-offload-dir", tmp_dir])
    with build_run(offloaded, device, VOCAB, log=lambda line: None) as run:
        streamed = run.offloaded.weights.model_state_dict(unwrap_model(run.model))
    assert streamed.keys() == reference.keys()
    return [k for k in reference if torch.is_tensor(reference[k])
            and not torch.equal(reference[k], streamed[k])]


@pytest.mark.parametrize("tie", [[], ["--untie-embeddings-and-output-weights"]])
def test_streamed_initial_weights_equal_megatrons(megatron_world, tmp_path, tie):
    assert _initial_weights_match([*FLAGS, *tie], str(tmp_path)) == []


def _tp_rank(rank, world, port, root, out):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_snake.training import distributed

    os.environ.update(distributed.local_rank_env(rank, world, port))
    torch.set_num_threads(1)
    distributed.initialize(device=torch.device("cpu"), tensor_model_parallel_size=2)
    os.makedirs(os.path.join(root, str(rank)), exist_ok=True)
    try:
        differing = _initial_weights_match(
            [*FLAGS, "--tensor-model-parallel-size", "2", "--untie-embeddings-and-output-weights"],
            os.path.join(root, str(rank)))
    finally:
        distributed.shutdown()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(differing, f)


def test_streamed_initial_weights_equal_megatrons_under_tp2(tmp_path):
    """Each tensor-parallel rank's shard, built out of memory, equals its shard of
    Megatron's in-memory build."""
    from megatron_snake.training.distributed import free_port

    mp.spawn(_tp_rank, args=(2, free_port(), str(tmp_path), str(tmp_path)), nprocs=2)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == []


# The child's peak RSS over its whole life: the log resets the OS's peak (VmHWM, and
# ru_maxrss with it) at every interval (/proc/self/clear_refs), so the peak is read before
# each reset (the model build and --load come before the first) and at the end, and the
# largest kept.
TRAIN = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, {repo!r})
    from megatron_snake.training import train_log
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.distributed import shutdown
    from megatron_snake.training.loop import pretrain
    peaks, reset = [], train_log.reset_peak_memory
    def reset_peak_memory(device):
        peaks.append(train_log.peak_rss_bytes())
        return reset(device)
    train_log.reset_peak_memory = reset_peak_memory
    losses = pretrain(parse_args(json.loads(sys.argv[1])))
    shutdown()
    peaks.append(train_log.peak_rss_bytes())
    print("RESULT", json.dumps({{"losses": losses, "peak_rss": max(peaks)}}))
""")

# 64 layers of hidden 512 (201M parameters, 4 GB of fp32 training state): many small units,
# so one unit's working set is small next to the model.
BIG = ["--num-layers", "64", "--hidden-size", "512", "--num-attention-heads", "8",
       "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "2",
       "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--deterministic-mode",
       "--device", "cpu", "--eval-interval", "1000", "--lr", "1e-4", "--log-interval", "1"]
FP32_STATE_BYTES_PER_PARAMETER = 4 + 4 + 4 + 8   # weights, gradient, master weights, moments


def train_in_subprocess(flags) -> tuple[list[float], int, str]:
    """Losses, the child's peak RSS over its whole life in bytes, and its output."""
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", TRAIN.format(repo=REPO), json.dumps(flags)],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(l for l in proc.stdout.splitlines()
                             if l.startswith("RESULT")).split(" ", 1)[1])
    return result["losses"], result["peak_rss"], proc.stdout


def _size(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"MiB": 2**20, "GiB": 2**30}[unit]


def test_training_state_four_times_the_peak_rss(tmp_path):
    """A GPT whose fp32 training state is >= 4x the peak RSS of the process that builds and
    trains it (and 15x its --snake-host-memory-limit), with the losses of the same model
    trained in memory by Megatron's schedule; the OS's peak RSS is the pre-flight's figure
    for the process within 15% (it printed the pool and the update alone: a third of it)."""
    offloaded, peak, out = train_in_subprocess(
        [*BIG, "--snake-offload", "--snake-offload-dir", str(tmp_path),
         "--snake-host-memory-limit", "256MiB"])
    params = float(re.search(r"> megatron_snake: ([0-9.]+)M parameters", out).group(1)) * 1e6
    state = params * FP32_STATE_BYTES_PER_PARAMETER
    predicted = _size(re.search(r"> pre-flight host: ([0-9.]+ [MG]iB) for the process",
                                out).group(1))
    print(f"training state {state / 2**30:.2f} GiB, peak RSS {peak / 2**30:.2f} GiB, "
          f"ratio {state / peak:.1f}; the pre-flight's {predicted / 2**30:.2f} GiB")
    assert state / peak >= 4, (state, peak)
    assert state >= 15 * (256 << 20)
    assert abs(predicted - peak) <= 0.15 * peak, (predicted, peak)
    # the log line says it too: host RSS for the interval, the pinned pool's high-water mark
    assert re.search(r"snake: peak RSS( \(cumulative\))? [0-9.]+ GiB", out), out[-2000:]
    pool = re.search(r"> pre-flight host: .*\(pool ([0-9.]+) MiB", out).group(1)
    assert re.search(rf"pool peak [0-9]+/{float(pool):.0f} MiB", out), out[-2000:]
    in_memory, _, _ = train_in_subprocess(BIG)
    assert offloaded[0] == in_memory[0], "same initial weights, same arithmetic"
    for it, (a, b) in enumerate(zip(in_memory, offloaded), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"iteration {it}: megatron {a} offloaded {b}"


def test_no_unit_gradient_outlives_its_hand_over(megatron_world, tmp_path):
    """After a step no unit's gradient buffer is still referenced: a parameter's view of it
    left behind kept every unit's fp32 gradient in memory (on a GPU, in device memory)
    until the next step."""
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.build import build_run
    from megatron_snake.training.data import random_microbatches

    args = parse_args([*FLAGS, "--snake-offload", "--snake-offload-dir", str(tmp_path)])
    with build_run(args, torch.device("cpu"), VOCAB, log=lambda line: None) as run:
        run.step(random_microbatches(2, 2, 16, VOCAB, seed=0))
        weights = run.offloaded.weights
        assert weights._grads == {}   # every buffer went to the optimizer
        assert weights._grad_views == {}, f"{len(weights._grad_views)} views still held"
