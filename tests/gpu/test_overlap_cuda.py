"""The overlap issue's gradient path on the device: per-parameter norms computed where the
gradients are (the device) equal the CPU ones, the norms stay on the device until the step
boundary, the gradient parts reach the host tier through the store's copy stream (host
first under clipping), and an fp16 overflow flag found on the device skips the step."""

from __future__ import annotations

import pytest
import torch

from conftest import build_model, tiny_args
from gpu_helpers import DEVICE, gpu_world, requires_device, sync  # noqa: F401
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW
from megatron_snake.optim.unit_params import UnitParams
from megatron_snake.storage.store import TensorStore

pytestmark = requires_device
MiB = 1 << 20


class _Scaler:
    """Megatron's loss-scaler interface, as much as the optimizer uses."""

    def __init__(self):
        self.scale = torch.tensor(4.0, device=DEVICE)
        self.found = []

    def update(self, found_inf):
        self.found.append(found_inf)


def _grad_norm(params, tmp_path, device, *, grad_scaler=None, poison=False):
    path = tmp_path / device.type
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    grads = {lay.key: torch.randn(lay.numel, generator=gen) for lay in params.all_layouts()}
    with TensorStore(path, host_memory_limit=256 * MiB, device=DEVICE) as store:
        opt = OffloadedAdamW(params, store, lr=1e-3, weight_decay=0.0, clip_grad=1.0,
                             alpha=0.3, grad_scaler=grad_scaler)
        try:
            for i, (key, grad) in enumerate(grads.items()):
                grad = grad.to(device)
                if poison and i == 1:
                    grad[3] = float("inf")
                opt.gradient_ready(key, grad)
            norms_device = {n.device.type for n in opt._norms.values()}
            sync()
            store.synchronize()
            tiers = {tuple(store.tiers(k)) for k in store.keys() if k[0] == "grad"}
            result = opt.step()
        finally:
            opt.close()
    return result, norms_device, tiers


def test_device_norms_equal_the_cpu_ones_and_gradients_go_to_host(gpu_world, tmp_path):
    params = UnitParams.of(GPTUnits(build_model(tiny_args(), DEVICE), 2))
    (ok_cpu, norm_cpu, _), _, _ = _grad_norm(params, tmp_path, torch.device("cpu"))
    (ok_dev, norm_dev, _), norms_on, tiers = _grad_norm(params, tmp_path, DEVICE)
    assert ok_cpu and ok_dev
    assert norm_dev == pytest.approx(norm_cpu, rel=1e-6)
    assert norms_on == {DEVICE.type}, "norms stay where the gradients are until step()"
    assert tiers == {("host",)}, "under clipping the gradients wait in host memory"


def test_an_overflow_found_on_the_device_skips_the_step(gpu_world, tmp_path):
    params = UnitParams.of(GPTUnits(build_model(tiny_args(), DEVICE), 2))
    scaler = _Scaler()
    (ok, norm, _), _, _ = _grad_norm(params, tmp_path, DEVICE, grad_scaler=scaler,
                                     poison=True)
    assert (ok, norm) == (False, None) and scaler.found == [True]
    scaler = _Scaler()
    (ok, _, _), _, _ = _grad_norm(params, tmp_path / "clean", DEVICE, grad_scaler=scaler)
    assert ok and scaler.found == [False]
