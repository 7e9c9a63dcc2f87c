"""What the two host-side AdamW optimizers share (the offloaded, exact one and ZenFlow's):
the state they keep, Megatron's parameter groups, the fused update, the clip coefficient,
and the interface the training loop drives, in the names of Megatron's optimizers."""

from __future__ import annotations

import math

import torch

from megatron_snake.errors import FlagError

STATES = ("master", "exp_avg", "exp_avg_sq")   # fp32 master weights and both moments


def megatron_param_groups(lr: float, weight_decay: float) -> list[dict]:
    """Two groups, so Megatron's OptimizerParamScheduler sets lr for both and weight decay
    only for the first (the second holds biases and 1-D parameters); both use the default
    settings (``default_config``: the group whose lr Megatron-LM logs)."""
    return [{"lr": lr, "weight_decay": weight_decay, "wd_mult": 1.0, "default_config": True},
            {"lr": lr, "weight_decay": 0.0, "wd_mult": 0.0, "default_config": True}]


def check_clip_grad(clip_grad: float) -> None:
    """``--clip-grad``: the global gradient-norm bound; 0 turns clipping off (Megatron's
    convention). A negative bound would flip every update's sign; an infinite one clips
    nothing while the update still waits for the global norm."""
    if not (math.isfinite(clip_grad) and clip_grad >= 0.0):
        raise FlagError(f"--clip-grad must be >= 0 and finite (0 turns clipping off), got "
                        f"{clip_grad}")


def clip_coefficient(clip_grad: float, total_norm: torch.Tensor) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient: clamped to 1, and applied even when it
    is 1, as torch does."""
    return torch.clamp(clip_grad / (total_norm + 1.0e-6), max=1.0)


def fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, step: torch.Tensor, *, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch's fused AdamW kernel (the one torch.optim.AdamW(fused=True) runs), in place on
    lists of tensors that share one step count: elementwise, so cutting a flat buffer into
    pieces changes no bit."""
    torch._fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, [], [step] * len(masters),
                        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                        amsgrad=False, maximize=False)


class HostAdamW:
    """The interface a training loop drives, this project's and Megatron-LM's alike, as it
    drives Megatron's optimizers (``MegatronOptimizer``): ``param_groups`` (Megatron's
    scheduler sets lr and weight decay there), ``zero_grad``, ``step() ->
    (update_successful, grad_norm, num_zeros_in_grad)``, ``scale_loss`` and
    ``get_loss_scale``, ``is_stub_optimizer``, ``state_dict``/``load_state_dict``; and,
    because the state lives off the compute device and updates run on worker threads,
    ``flush`` (apply what is pending) and ``close``."""

    param_groups: list
    is_stub_optimizer = False   # Megatron-LM's loop skips a rank's optimizer that has none

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    def step(self):
        raise NotImplementedError

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(1.0)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Megatron's ``optimizer.scale_loss``: the loss times the current loss scale."""
        return loss * self.get_loss_scale()

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
