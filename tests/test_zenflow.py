"""--snake-zenflow: the exact corner cases equal exact AdamW, the columns are the ones a plain
reference picks, a few hundred steps end within 2% of the exact run's loss, bad flags fail,
and a checkpoint resumes ZenFlow's in-flight state exactly.

The exact reference is the one tests/test_offloaded_training.py proves bit-identical to the
offloaded AdamW of --snake-offload: torch's clip_grad_norm_ + torch.optim.AdamW(fused=True)
with Megatron's no-decay rule and Megatron's OptimizerParamScheduler, on Megatron-Core's own
schedule.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import (build_model, expect_flag_error, make_microbatches,
                      megatron_forward_backward, tiny_args, torch_adamw,
                      cosine_scheduler)
from megatron_snake.optim.zenflow import ZenFlowAdamW, ZenFlowSettings
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.loop import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR, WD, STEPS, CLIP = 5e-3, 0.1, 6, 0.5
SMALL = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "6",
         "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--seed", "5",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def _train(model, batches, make_optimizer, before_step=None):
    opt = make_optimizer(model)
    sched = cosine_scheduler(opt, LR, WD, STEPS)
    for mbs in batches:
        opt.zero_grad(set_to_none=True)
        megatron_forward_backward(model, mbs)
        if before_step is not None:
            before_step(opt)
        if isinstance(opt, torch.optim.AdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step(increment=1)
    if hasattr(opt, "close"):
        opt.close()
    return opt


def _torch_adamw(model):
    return torch_adamw(model, LR, WD)


def _zenflow(**settings):
    def make(model):
        return ZenFlowAdamW(model.named_parameters(), lr=LR, weight_decay=WD, clip_grad=CLIP,
                            settings=ZenFlowSettings(**settings))
    return make


@pytest.mark.parametrize("settings", [
    dict(topk_ratio=1.0, update_interval=2, select_interval=2, overlap_step=True),
    dict(topk_ratio=0.25, update_interval=1, select_interval=2, overlap_step=False),
    dict(topk_ratio=0.25, update_interval=1, select_interval=3, overlap_step=False,
         full_warmup_steps=2),
], ids=["topk-1.0", "update-interval-1", "update-interval-1+warmup"])
def test_exact_corner_cases_equal_exact_adamw(megatron_world, settings):
    """All columns important, or every column updated every step without overlap: each
    element gets AdamW's update at every step, with the same fused kernel on the same
    values (on the device for important columns, on the host for the rest): within 1e-6
    relative of the exact AdamW after six steps (measured: bit-identical)."""
    torch.use_deterministic_algorithms(True)
    args = tiny_args("--untie-embeddings-and-output-weights", "--position-embedding-type",
                     "rope")
    batches = [make_microbatches(2, seed=s) for s in range(STEPS)]
    reference, ours = build_model(args, megatron_world), build_model(args, megatron_world)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    _train(reference, batches, _torch_adamw)
    opt = _train(ours, batches, _zenflow(**settings))
    torch.use_deterministic_algorithms(False)
    assert opt.selected_at is not None, "ZenFlow steps were taken (not only warm-up)"
    ref = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        assert not torch.equal(ref[name].detach(), initial[name]), f"{name} never moved"
        rel = ((p.detach() - ref[name].detach()).norm() / ref[name].detach().norm()).item()
        assert rel <= 1e-6, f"{name}: relative weight difference {rel:.2e}"


def _reference_columns(grad: torch.Tensor, ratio: float) -> list[int]:
    """Plain selection: score each column by the sum of |g| over its rows, keep the
    round(ratio * columns) best."""
    rows, cols = grad.shape
    scores = [sum(abs(float(grad[i, j])) for i in range(rows)) for j in range(cols)]
    k = max(1, round(ratio * cols))
    return sorted(sorted(range(cols), key=lambda j: -scores[j])[:k])


def test_selected_columns_equal_a_plain_reference(megatron_world):
    """At the first step and at every re-selection (select-interval 4, update-interval 2),
    each 2-D weight's important columns are the reference's on that step's gradient;
    1-D parameters are always selected whole."""
    args = tiny_args("--hidden-size", "16", "--num-attention-heads", "2", "--num-layers", "2",
                     "--untie-embeddings-and-output-weights")
    model = build_model(args, megatron_world)
    ratio, expected, checked = 0.3, {}, []

    def record(opt):
        if opt.window == 0 and (opt.selected_at is None or
                                opt.iteration + 1 - opt.selected_at >= 4):
            expected[opt.iteration + 1] = {
                n: _reference_columns(p.grad, ratio) for n, p in model.named_parameters()
                if p.dim() == 2}
        if opt.selected_at is not None and opt.selected_at in expected:
            step = opt.selected_at
            for zp in opt.params:
                if zp.always:
                    assert zp.idx.tolist() == list(range(zp.param.numel())), zp.name
                else:
                    assert zp.idx.tolist() == expected[step][zp.name], (step, zp.name)
            checked.append(step)

    batches = [make_microbatches(2, seed=s) for s in range(10)]
    _train(model, batches, _zenflow(topk_ratio=ratio, update_interval=2, select_interval=4,
                                    overlap_step=True), before_step=record)
    assert sorted(set(checked)) == [1, 5, 9], checked


def _docstring_corpus(tmp_path) -> str:
    """A small real text: the docstrings of Python's standard library (about 0.8 MB),
    byte-tokenized by tools/preprocess_data.py. Returns the --data-path prefix."""
    import ast
    import json
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    corpus = tmp_path / "docstrings.jsonl"
    with open(corpus, "w") as out:
        for name in sorted(os.listdir(stdlib)):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(open(os.path.join(stdlib, name), encoding="utf-8").read())
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 80:
                        out.write(json.dumps({"text": doc}) + "\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                           "--input", str(corpus), "--output-prefix",
                           str(tmp_path / "docstrings"), "--append-eod"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return str(tmp_path / "docstrings_text_document")


def test_fine_tuning_few_hundred_steps_within_two_percent_of_exact(megatron_world, tmp_path):
    """ZenFlow's use case, fine-tuning: a GPT pretrained exactly (200 steps at lr 1e-2 on a
    small real text) is fine-tuned 200 more steps at lr 1e-3 with a fresh optimizer, exact
    and with ZenFlow (DeepSpeed's ratio 0.1, update interval 4 overlapped, re-selection
    every 50): final losses (mean of the last 20 steps) within 2% (measured: 0.5%).
    From scratch, where progress is limited by the learning rate, the other columns' one
    AdamW step per window costs more (README, ZenFlow mode). The fresh ZenFlow optimizer must
    take its master weights from the loaded model (--no-load-optim), not from the random
    initialization it was built on: otherwise this is 6% off."""
    data = ["--data-path", _docstring_corpus(tmp_path), "--split", "98,2,0",
            "--data-cache-path", str(tmp_path / "cache"), "--eval-interval", "100000",
            "--global-batch-size", "4", "--log-interval", "100"]
    ckpt = str(tmp_path / "pretrained")
    pretrained = pretrain(parse_args([*SMALL, *data, "--train-iters", "200", "--lr", "1e-2",
                                      "--save", ckpt]))
    tune = [*SMALL, *data, "--train-iters", "400", "--lr", "1e-3", "--lr-warmup-iters", "0",
            "--lr-decay-style", "constant", "--load", ckpt, "--no-load-optim"]
    exact = pretrain(parse_args(tune))
    zen = pretrain(parse_args([*tune, "--snake-zenflow", "--snake-zenflow-overlap-step",
                               "--snake-zenflow-select-interval", "50"]))
    assert len(exact) == len(zen) == 200
    tail_exact, tail_zen = sum(exact[-20:]) / 20, sum(zen[-20:]) / 20
    assert tail_exact < sum(pretrained[-20:]) / 20, "the exact fine-tuning must improve"
    assert abs(tail_zen - tail_exact) <= 0.02 * tail_exact, (tail_zen, tail_exact)


def test_topk_one_matches_snake_offload_run(megatron_world, tmp_path):
    """End to end through pretrain: --snake-zenflow with topk-ratio 1.0 against the exact
    offloaded AdamW of --snake-offload (untied, two micro-batches: the same gradients)."""
    flags = [*SMALL, "--train-iters", "6", "--deterministic-mode", "--global-batch-size", "4",
             "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope"]
    offloaded = pretrain(parse_args([*flags, "--snake-offload", "--snake-offload-dir",
                                     str(tmp_path), "--snake-optimizer-tier", "host",
                                     "--snake-param-tier", "host",
                                     "--snake-activation-tier", "host"]))
    zen = pretrain(parse_args([*flags, "--snake-zenflow", "--snake-zenflow-topk-ratio", "1.0",
                               "--snake-zenflow-overlap-step"]))
    for a, b in zip(offloaded, zen):
        assert abs(a - b) <= 1e-6 * abs(a), (offloaded, zen)


def test_resume_restores_the_update_in_flight(megatron_world, tmp_path):
    """Saved at step 5 with a CPU update in flight (update interval 2, overlapped) and a
    half-full accumulator: the resumed run prints the uninterrupted run's losses."""
    flags = [*SMALL, "--train-iters", "10", "--deterministic-mode", "--hidden-dropout", "0.1",
             "--snake-zenflow", "--snake-zenflow-update-interval", "2",
             "--snake-zenflow-select-interval", "4", "--snake-zenflow-overlap-step",
             "--snake-zenflow-topk-ratio", "0.25"]
    full = pretrain(parse_args(flags))
    pretrain(parse_args([*flags, "--exit-interval", "5", "--save", str(tmp_path)]))
    resumed = pretrain(parse_args([*flags, "--load", str(tmp_path)]))
    assert resumed == full[5:], (resumed, full[5:])


def test_log_says_approximate_and_reports_selection(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), *SMALL,
         "--train-iters", "6", "--device", "cpu", "--snake-zenflow",
         "--snake-zenflow-update-interval", "2", "--snake-zenflow-select-interval", "100",
         "--snake-zenflow-overlap-step", "--snake-zenflow-full-warmup-steps", "1"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZenFlow APPROXIMATE mode" in proc.stdout
    fields = re.findall(r"zenflow selected: ([0-9.]+) \| zenflow pending age: (\d+)",
                        proc.stdout)
    assert len(fields) == 6, proc.stdout[-3000:]
    assert fields[0] == ("1.000", "0"), "warm-up step: every element, exactly"
    assert all(0.0 < float(sel) < 0.2 for sel, _ in fields[1:])
    # Windows end at steps 3 and 5: the overlapped update is in flight one step later.
    assert [age for _, age in fields] == ["0", "0", "0", "1", "0", "1"]


def _script_losses(*flags: str, nproc: int = 1) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(29500 + os.getpid() % 1000)]
    proc = subprocess.run([*launcher, os.path.join(ROOT, "examples", "pretrain_gpt.py"),
                           *flags], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)]


def test_data_parallel_ranks_update_the_same_columns():
    """DP = 2: gradients are all-reduced before the selection and rank 0's columns are
    broadcast, so both ranks hold the same weights and train like one rank with the same
    global batch (only gradient sums are reordered: losses within 1e-5)."""
    flags = [*SMALL, "--train-iters", "8", "--device", "cpu", "--global-batch-size", "4",
             "--deterministic-mode", "--snake-zenflow", "--snake-zenflow-update-interval", "2",
             "--snake-zenflow-select-interval", "4", "--snake-zenflow-overlap-step",
             "--snake-zenflow-topk-ratio", "0.25"]
    one = _script_losses(*flags)
    two = _script_losses(*flags, nproc=2)
    assert len(one) == len(two) == 8
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)


@pytest.mark.parametrize("flags,flag_named", [
    (["--snake-zenflow", "--snake-zenflow-topk-ratio", "0"], "--snake-zenflow-topk-ratio"),
    (["--snake-zenflow", "--snake-zenflow-topk-ratio", "1.5"], "--snake-zenflow-topk-ratio"),
    (["--snake-zenflow", "--snake-zenflow-topk-ratio", "-0.1"], "--snake-zenflow-topk-ratio"),
    (["--snake-zenflow", "--snake-zenflow-select-interval", "2",
      "--snake-zenflow-update-interval", "4"], "--snake-zenflow-select-interval"),
    (["--snake-zenflow", "--snake-zenflow-update-interval", "0"],
     "--snake-zenflow-update-interval"),
    (["--snake-zenflow", "--snake-zenflow-full-warmup-steps", "-1"],
     "--snake-zenflow-full-warmup-steps"),
    (["--snake-zenflow-topk-ratio", "0.2"], "--snake-zenflow-topk-ratio"),
    (["--snake-zenflow-overlap-step"], "--snake-zenflow-overlap-step"),
    (["--snake-zenflow", "--fp16"], "--fp16"),
])
def test_bad_zenflow_flags_fail_naming_the_flag(capsys, flags, flag_named):
    expect_flag_error(capsys, flags, flag_named)


def test_zenflow_with_snake_offload_is_refused_naming_both(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--snake-zenflow", "--snake-offload"])
    err = capsys.readouterr().err
    assert "--snake-zenflow" in err and "--snake-offload" in err, err


def test_settings_reject_bad_values_outside_the_cli():
    with pytest.raises(ValueError, match="topk-ratio"):
        ZenFlowSettings(topk_ratio=0.0)
    with pytest.raises(ValueError, match="select-interval"):
        ZenFlowSettings(select_interval=1, update_interval=2)
