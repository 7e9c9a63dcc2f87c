"""Shared fixtures: one single-rank Megatron world per test process, tiny GPTs, micro-batches,
and Megatron-Core's own schedule as the reference."""

from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

VOCAB = 128


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed (gloo, world size 1) + Megatron parallel state, on the CPU."""
    from megatron_snake.training import distributed

    torch.set_num_threads(1)  # 2 cores; spawned ranks and helpers must not oversubscribe
    device = distributed.resolve_device("cpu")
    distributed.initialize(device=device, seed=1234)
    yield device
    distributed.shutdown()


def tiny_args(*extra: str):
    """Parsed pretrain_gpt flags for a tiny fp32 GPT without dropout."""
    from megatron_snake.training.arguments import parse_args

    base = ["--num-layers", "5", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--hidden-dropout", "0", "--attention-dropout", "0"]
    return parse_args(base + list(extra))


def checkpoint_flags(ckpt_format: str) -> list[str]:
    """pretrain_gpt's flags for the small offloaded run whose checkpoint the fault tests save
    and break (dropout on: resuming exactly needs the RNG streams and the data position back
    too)."""
    return ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "6",
            "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--seed", "5",
            "--train-iters", "4", "--deterministic-mode", "--snake-offload",
            "--ckpt-format", ckpt_format]


@pytest.fixture(scope="module")
def saved(megatron_world, tmp_path_factory, saved_format):
    """A real checkpoint of iteration 2 of ``checkpoint_flags(saved_format)`` (the run
    stopped by --exit-interval 2), saved once per module; the module names its format with
    a ``saved_format`` fixture."""
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    root = tmp_path_factory.mktemp("saved") / "ckpt"
    pretrain(parse_args([*checkpoint_flags(saved_format), "--exit-interval", "2",
                         "--save", str(root)]))
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    return root


def build_model(args, device, seed: int = 7):
    from megatron_snake.training.distributed import set_seed
    from megatron_snake.training.model import build_gpt_model

    set_seed(seed)
    return build_gpt_model(args, VOCAB, device)


def make_microbatches(num: int, batch: int = 2, seq: int = 16, seed: int = 0,
                      vocab: int = VOCAB):
    """Random GPT micro-batches with Megatron's keys; the loss mask drops a few tokens."""
    from megatron_snake.training.data import random_microbatches

    return random_microbatches(num, batch, seq, vocab, seed=seed, loss_mask_drop=0.1)


def megatron_forward_backward(model, microbatches, forward_only: bool = False):
    """Megatron-Core's forward_backward_no_pipelining with pretrain_gpt's forward step and
    loss. Returns per-micro-batch masked-mean losses."""
    from megatron_snake.training.step import megatron_forward_backward as reference

    return reference(model, microbatches, forward_only=forward_only)


def torch_adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's fused AdamW with Megatron's no-decay rule (biases and 1-D parameters) and
    Megatron's param-group keys, so Megatron's scheduler can drive it: the reference the
    offloaded optimizers are compared with."""
    from megatron_snake.optim.unit_params import no_weight_decay

    decay = [p for n, p in model.named_parameters() if not no_weight_decay(n, p)]
    no_decay = [p for n, p in model.named_parameters() if no_weight_decay(n, p)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
                              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}],
                             lr=lr, fused=True)


def cosine_scheduler(optimizer, lr: float, weight_decay: float, steps: int):
    """Megatron's OptimizerParamScheduler as the optimizer tests use it: 2 warm-up steps,
    cosine decay to lr / 10 over ``steps``, constant weight decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=2,
        lr_decay_steps=steps, lr_decay_style="cosine", start_wd=weight_decay,
        end_wd=weight_decay, wd_incr_steps=steps, wd_incr_style="constant")


def reference_training(model, batches, *, clip: float, lr: float, weight_decay: float,
                       steps: int) -> list:
    """What the offloaded optimizer is held to: per step, Megatron-Core's schedule, torch's
    clip_grad_norm_ (when ``clip``), torch's fused AdamW under Megatron's scheduler. Returns
    each step's per-micro-batch losses."""
    opt = torch_adamw(model, lr, weight_decay)
    sched = cosine_scheduler(opt, lr, weight_decay, steps)
    losses = []
    for mbs in batches:
        opt.zero_grad(set_to_none=True)
        losses.append(megatron_forward_backward(model, mbs))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step(increment=1)
    return losses


def hold_nvme_writes(store, monkeypatch):
    """Make ``store``'s NVMe writes wait until the returned event is set, so a put stays in
    flight (the forwarding tests): every drive write of a record passes the drive tier's
    ``write_bytes``."""
    import threading

    gate = threading.Event()
    write = store._drive.write_bytes

    def gated_write(*args, **kwargs):
        assert gate.wait(30), "test gate never opened"
        return write(*args, **kwargs)

    monkeypatch.setattr(store._drive, "write_bytes", gated_write)
    return gate


def gradients(model) -> dict[str, torch.Tensor]:
    """Accumulated gradients by name: ``main_grad`` under Megatron DDP, else ``grad``."""
    grads = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        grads[name] = (p.grad if g is None else g).detach().clone()
    return grads


def zero_gradients(model) -> None:
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    for p in model.parameters():
        p.grad = None


def expect_flag_error(capsys, flags: list[str], flag_named: str) -> str:
    """pretrain_gpt's flags ``flags`` are refused with one argparse error naming
    ``flag_named``; returns the error text."""
    from megatron_snake.training.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag_named in err, err
    assert err.count("error:") == 1
    return err
