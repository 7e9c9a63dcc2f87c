"""examples/pretrain_gpt.py end to end: the snake schedule trains to Megatron's losses,
checkpoints resume exactly, and bad flags fail with one clear error naming the flag."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import expect_flag_error
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.checkpoint_dir import find_checkpoint
from megatron_snake.training.loop import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
SMALL = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "6",
         "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--seed", "5"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _run_script(*flags: str) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)]
    assert losses, proc.stdout[-3000:]
    return losses


def test_script_snake_matches_megatron_schedule():
    """Same seed, no dropout, deterministic: 10 iterations of losses within 1e-5."""
    common = [*SMALL, *NO_DROPOUT, "--train-iters", "10", "--deterministic-mode",
              "--position-embedding-type", "rope", "--device", "cpu"]
    megatron = _run_script(*common)
    snake = _run_script(*common, "--snake-offload", "--snake-checkpoint-interval", "2")
    assert len(megatron) == len(snake) == 10
    assert megatron[-1] < megatron[0], "the run must actually train"
    for it, (a, b) in enumerate(zip(megatron, snake), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"iteration {it}: megatron {a} snake {b}"


@pytest.mark.parametrize("snake", [True, False])
def test_save_and_resume_reproduces_losses(megatron_world, tmp_path, snake):
    """Dropout on, so resuming must also restore the RNG streams and the data position."""
    flags = [*SMALL, "--train-iters", "10", "--deterministic-mode", "--eval-interval", "4",
             "--eval-iters", "1"] + (["--snake-offload"] if snake else [])
    full = pretrain(parse_args(flags))
    pretrain(parse_args([*flags, "--exit-interval", "5", "--save", str(tmp_path)]))
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "5"
    resumed = pretrain(parse_args([*flags, "--load", str(tmp_path)]))
    assert len(resumed) == 5
    assert resumed == full[5:], (resumed, full[5:])


def test_no_load_optim_takes_the_loaded_weights_as_master_weights(megatron_world, tmp_path):
    """--load --no-load-optim: a fresh optimizer whose fp32 master weights are the loaded
    weights (Megatron-LM's reload_model_params), with --snake-offload as without it: the
    same losses after the load, and not the losses of the random initialisation."""
    flags = [*SMALL, *NO_DROPOUT, "--deterministic-mode"]
    trained = pretrain(parse_args([*flags, "--train-iters", "6", "--snake-offload",
                                   "--save", str(tmp_path)]))
    after = [*flags, "--train-iters", "9", "--load", str(tmp_path), "--no-load-optim"]
    megatron = pretrain(parse_args(after))
    snake = pretrain(parse_args([*after, "--snake-offload"]))
    assert len(megatron) == len(snake) == 3
    for it, (a, b) in enumerate(zip(megatron, snake), start=7):
        assert abs(a - b) <= 1e-5 * abs(a), f"iteration {it}: megatron {a} snake {b}"
    assert snake[-1] < trained[0] - 0.1, "the run went on from the loaded weights"


def test_save_interval_and_atomic_layout(megatron_world, tmp_path):
    flags = [*SMALL, *NO_DROPOUT, "--train-iters", "4", "--snake-offload", "--save",
             str(tmp_path), "--save-interval", "2"]
    pretrain(parse_args(flags))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000004",
                                             "latest_checkpointed_iteration.txt"]
    # Megatron's torch_dist files (the default format)
    assert sorted(os.listdir(tmp_path / "iter_0000004")) == [
        ".metadata", "__0_0.distcp", "common.pt", "metadata.json"]


def test_load_with_other_model_shape_fails(megatron_world, tmp_path):
    pretrain(parse_args([*SMALL, "--train-iters", "3", "--save", str(tmp_path)]))
    other = [a if a != "3" else "4" for a in SMALL]  # --num-layers 4
    with pytest.raises(ValueError, match="--num-layers saved 3 now 4"):
        pretrain(parse_args([*other, "--train-iters", "4", "--load", str(tmp_path)]))


@pytest.mark.parametrize("flags,flag_named", [
    (["--global-batch-size", "7", "--micro-batch-size", "2"], "--global-batch-size"),
    (["--snake-checkpoint-interval", "0"], "--snake-checkpoint-interval"),
    (["--snake-schedule", "diagonal"], "--snake-schedule"),
    (["--load", "/nonexistent/megatron_snake_ckpt"], "--load"),
    (["--bf16", "--fp16"], "--bf16"),
    (["--hidden-size", "30", "--num-attention-heads", "4"], "--num-attention-heads"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups"),
    (["--snake-offlaod"], "--snake-offlaod"),
    (["--lr-warmup-iters", "20", "--train-iters", "20"], "--lr-warmup-iters"),
    (["--snake-offload", "--snake-alpha", "0.7"], "--snake-alpha"),
    (["--snake-alpha", "0.3"], "--snake-alpha"),  # without --snake-offload: not ignored
    (["--snake-gpu-memory-limit", "1GiB"], "--snake-gpu-memory-limit"),
    (["--snake-offload", "--snake-schedule", "horizontal", "--snake-activation-tier", "auto"],
     "--snake-activation-tier"),
    (["--snake-param-tier", "device"], "--snake-param-tier"),
    (["--snake-activation-offload", "--snake-activation-tier", "device"],
     "--snake-activation-tier"),
])
def test_bad_flags_fail_naming_the_flag(capsys, flags, flag_named):
    expect_flag_error(capsys, flags, flag_named)


def _component_error(rule, *values) -> str:
    with pytest.raises(ValueError) as exc:
        rule(*values)
    return str(exc.value)


def test_a_flag_rule_has_one_source(capsys):
    """The command line refuses a bad value with the component's own message: the rule is
    written once, beside the component, and the flag check calls it."""
    from megatron_snake.models.gpt_units import check_checkpoint_interval
    from megatron_snake.optim.parts import check_alpha
    from megatron_snake.optim.zenflow import ZenFlowSettings
    from megatron_snake.schedule.pipeline import snake_groups
    from megatron_snake.training.distributed import data_parallel_size
    from megatron_snake.training.tokenizer import build_tokenizer

    cases = [
        (["--snake-checkpoint-interval", "0"], check_checkpoint_interval, 0),
        (["--snake-offload", "--snake-alpha", "0.7"], check_alpha, 0.7),
        (["--snake-offload", "--snake-group-size", "3"], snake_groups, 4, 3),
        (["--tensor-model-parallel-size", "2"], data_parallel_size, 1, 2, 1),
        (["--tokenizer-type", "NullTokenizer"], build_tokenizer, "NullTokenizer", None),
        (["--snake-zenflow", "--snake-zenflow-topk-ratio", "0"],
         lambda: ZenFlowSettings(topk_ratio=0.0)),
        (["--snake-zenflow", "--snake-zenflow-update-interval", "200"],
         lambda: ZenFlowSettings(update_interval=200)),
    ]
    for flags, rule, *values in cases:
        message = _component_error(rule, *values)
        assert message.startswith("--"), message  # names its flag
        assert message in expect_flag_error(capsys, flags, flags[-2])


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_half_precision_snake_matches_megatron(megatron_world, precision):
    """bf16 / fp16 working weights (Float16Module), fp32 gradient accumulation and fp32
    master weights on both sides (Megatron's DDP main_grad and mixed-precision optimizer;
    the offloaded AdamW here), fp16 with Megatron's dynamic loss scaler: per-micro-batch
    arithmetic is the same, only gradient sums are reordered, so the losses agree within
    half-precision rounding, and fp16 skips the same overflowing steps."""
    flags = [*SMALL, *NO_DROPOUT, "--train-iters", "6", "--deterministic-mode", precision,
             "--initial-loss-scale", "1024"]
    megatron = pretrain(parse_args(flags))
    snake = pretrain(parse_args([*flags, "--snake-offload"]))
    assert megatron[0] == snake[0], "first step: same weights, same per-micro-batch arithmetic"
    assert snake[-1] < snake[0] - 0.1, "the steps were taken, not skipped"
    # Measured: bf16 within ~1e-5, fp16 within ~1e-6. The bound is tight enough to catch a
    # gradient unscaled twice (fp16 then drifts by ~3e-4 in five steps).
    for a, b in zip(megatron, snake):
        assert abs(a - b) <= 1e-4 * abs(a), (megatron, snake)


def test_real_text_dataset_end_to_end(megatron_world, tmp_path):
    """tools/preprocess_data.py -> --data-path: the byte tokenizer's indexed dataset trains."""
    corpus = tmp_path / "corpus.jsonl"
    docs = [f'{{"text": "document {i}: the quick brown fox jumps over the lazy dog {i * 7}."}}'
            for i in range(200)]
    corpus.write_text("\n".join(docs) + "\n")
    prefix = tmp_path / "corpus"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                           "--input", str(corpus), "--output-prefix", str(prefix),
                           "--append-eod"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = str(prefix) + "_text_document"
    assert os.path.isfile(data + ".bin") and os.path.isfile(data + ".idx")
    flags = [*SMALL, *NO_DROPOUT, "--train-iters", "8", "--data-path", data, "--split",
             "90,10,0", "--eval-interval", "4", "--eval-iters", "1", "--lr", "1e-2",
             "--data-cache-path", str(tmp_path / "cache")]
    snake = pretrain(parse_args([*flags, "--snake-offload"]))
    megatron = pretrain(parse_args(flags))
    assert snake[-1] < snake[0]
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(megatron, snake))


@pytest.mark.parametrize("policy", ["adaptive", "all"])
def test_activation_offload_with_megatron_schedule_changes_no_number(megatron_world, tmp_path,
                                                                   policy):
    """--snake-activation-offload (SSDTrain on Megatron's own schedule): dropout on, same
    seed, every loss bit-identical to the run without it; the adaptive policy leaves its
    plan in the offload directory, nothing else stays."""
    flags = [*SMALL, "--train-iters", "4", "--deterministic-mode", "--hidden-size", "64",
             "--seq-length", "64"]
    plain = pretrain(parse_args(flags))
    offloaded = pretrain(parse_args([*flags, "--snake-activation-offload",
                                     "--snake-activation-offload-policy", policy,
                                     "--snake-activation-offload-min-bytes", "4096",
                                     "--snake-offload-dir", str(tmp_path)]))
    assert offloaded == plain
    plan = ["saved_tensor_plan_rank0.json"] if policy == "adaptive" else []
    assert os.listdir(tmp_path) == plan or sorted(os.listdir(tmp_path)) == ["rank0", *plan] \
        and os.listdir(tmp_path / "rank0") == []


def test_sigkill_during_a_step_then_resume(tmp_path):
    """Save at step 3, SIGKILL the run during step 5, --load: steps 4 to 6 print the
    uninterrupted run's losses (offloaded state, dropout on)."""
    import signal

    common = [*SMALL, "--train-iters", "6", "--snake-offload", "--deterministic-mode",
              "--device", "cpu"]
    full = _run_script(*common)
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, SCRIPT, *common, "--save", str(ckpt),
                             "--save-interval", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stdout:
        if "iteration        4/" in line:  # step 5 is running now
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    resumed = _run_script(*common, "--load", str(ckpt))
    assert resumed == full[3:]


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_crash_during_save_keeps_previous_checkpoint(megatron_world, tmp_path, monkeypatch,
                                                     ckpt_format):
    """The second save fails half-way (torch: at its state file; torch_dist: at its first
    piece of offloaded state): an error naming the failure, the first checkpoint intact."""
    from megatron_snake.training import checkpointing, torch_dist_offloaded

    flags = [*SMALL, *NO_DROPOUT, "--train-iters", "4", "--snake-offload", "--save",
             str(tmp_path), "--save-interval", "2", "--ckpt-format", ckpt_format]
    real_save, real_stream, calls = checkpointing.torch.save, torch_dist_offloaded.stream_save, []

    def crashing_save(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk unplugged in the middle of the save")
        return real_save(obj, path, *args, **kwargs)

    def crashing_stream(sharded, common, directory, produce, *args, **kwargs):
        calls.append(directory)

        def produce_or_fail(*piece):
            if len(calls) == 2:
                raise OSError("disk unplugged in the middle of the save")
            return produce(*piece)
        return real_stream(sharded, common, directory, produce_or_fail, *args, **kwargs)

    if ckpt_format == "torch":
        monkeypatch.setattr(checkpointing.torch, "save", crashing_save)
    else:
        monkeypatch.setattr(torch_dist_offloaded, "stream_save", crashing_stream)
    with pytest.raises(OSError, match="disk unplugged"):
        pretrain(parse_args(flags))
    monkeypatch.undo()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert find_checkpoint(str(tmp_path)).iteration == 2
    resumed = pretrain(parse_args([*flags, "--load", str(tmp_path), "--save-interval", "100"]))
    assert len(resumed) == 2


def test_offload_limits_fail_before_the_first_step(megatron_world, tmp_path, monkeypatch):
    """A device limit below one unit's working set, and a drive too small for the plan:
    one clear error each, naming the flag and the minimum, before any step runs."""
    from megatron_snake.storage import directory
    from megatron_snake.storage.errors import CapacityError

    flags = [*SMALL, "--train-iters", "3", "--snake-offload", "--snake-offload-dir",
             str(tmp_path)]
    with pytest.raises(ValueError, match=r"--snake-gpu-memory-limit 0.1 MiB .* the minimum is "
                                         r"\d+ bytes"):
        pretrain(parse_args([*flags, "--snake-gpu-memory-limit", "100KiB"]))
    pretrain(parse_args([*flags, "--snake-gpu-memory-limit", "64MiB"]))  # enough

    monkeypatch.setattr(directory, "disk_free_bytes", lambda path: 1 << 20)
    with pytest.raises(CapacityError, match="--snake-offload-dir .* needs"):
        pretrain(parse_args(flags))
    assert not os.path.exists(tmp_path / "rank0"), "nothing left behind"


def test_fp16_overflow_skips_the_same_steps(megatron_world):
    """An initial loss scale of 2^32 overflows fp16 gradients: Megatron's optimizer and the
    offloaded one both skip those steps (weights unchanged: the same losses follow) while
    the dynamic scaler backs off."""
    flags = [*SMALL, *NO_DROPOUT, "--train-iters", "4", "--fp16", "--deterministic-mode",
             "--initial-loss-scale", "4294967296"]
    assert pretrain(parse_args([*flags, "--snake-offload"])) == pretrain(parse_args(flags))


def test_fp16_resume_restores_the_loss_scale(megatron_world, tmp_path):
    """fp16 with --snake-offload: the dynamic loss scale (2^20 overflows this model's
    first gradients and backs off) and its counters are part of the checkpoint, so a
    resumed run skips exactly the steps the straight run skips (a fresh scaler would
    overflow again after the resume)."""
    flags = [*SMALL, *NO_DROPOUT, "--train-iters", "8", "--fp16", "--deterministic-mode",
             "--initial-loss-scale", "1048576", "--snake-offload"]
    full = pretrain(parse_args(flags))
    pretrain(parse_args([*flags, "--exit-interval", "4", "--save", str(tmp_path)]))
    resumed = pretrain(parse_args([*flags, "--load", str(tmp_path)]))
    assert resumed == full[4:], (resumed, full[4:])


def test_activation_offload_inside_the_vertical_recompute(megatron_world, tmp_path, capfd):
    """--snake-offload --snake-activation-offload: the tensors autograd saves while a unit
    is recomputed go to NVMe too; dropout on, every loss bit-identical. The log line with
    --snake-log-details shows both activation peaks per tier and the prefetch wait apart from
    other I/O waits."""
    flags = [*SMALL, "--train-iters", "3", "--deterministic-mode", "--hidden-size", "64",
             "--seq-length", "64", "--snake-offload", "--snake-offload-dir", str(tmp_path),
             "--snake-activation-tier", "nvme"]
    plain = pretrain(parse_args(flags))
    capfd.readouterr()
    offloaded = pretrain(parse_args([*flags, "--snake-activation-offload",
                                     "--snake-activation-offload-min-bytes", "4096",
                                     "--snake-log-details"]))
    assert offloaded == plain
    line = [l for l in capfd.readouterr().out.splitlines() if "iteration        3/" in l][0]
    for part in ("unit inputs peak (last step) nvme", "saved tensors peak (last step) device",
                 "prefetch wait (interval)",
                 "other io wait"):
        assert part in line, line
