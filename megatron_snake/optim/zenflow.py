"""ZenFlow (``--snake-zenflow``): important gradient columns updated at once on the compute
device, the rest accumulated in host memory and applied by a CPU AdamW every few steps.

Like DeepSpeed's ZenFlow on ZeRO-Offload, the model's working weights stay on the compute
device and the optimizer state lives on the host: fp32 master weights, both Adam moments and
a gradient accumulator per parameter, in host memory. What one step does:

1. Global gradient norm and clip coefficient, as ``torch.nn.utils.clip_grad_norm_`` does.
2. The first ``full_warmup_steps`` steps are exact offloaded AdamW (ZeRO-Offload): every
   gradient goes to the host, the CPU steps every element, the weights come back.
3. At a *selection* (the first step after warm-up, then at the first window start at least
   ``select_interval`` steps after the last) the important columns of every 2-D weight are
   chosen from this step's gradient (``zenflow_select``); their master weights and moments
   move to the device (the previous selection's go back to the host first). Selections
   happen only at window starts, when no update is in flight and the accumulator is empty,
   so no gradient or state is ever in two places.
4. Important columns and every non-2-D parameter: fused AdamW on the device, at once, with
   this step's gradient; their working weights are rewritten from the device master.
5. The other columns: this step's (clipped) gradient goes to the host accumulator. After
   ``update_interval`` steps (a *window*) the CPU applies AdamW once with the window's mean
   gradient, at the lr the scheduler set for the window's last step (ZenFlow applies the
   accumulated gradient once, with the current lr). Without ``overlap_step`` the update runs at
   once and the weights are refreshed before the next forward; with ``overlap_step`` it runs on
   a worker thread during the next window's compute and *lands* (the device working weights
   of those columns are refreshed) at the end of the next window, right before the next
   CPU update starts: the compute never waits unless the CPU is slower than a window.

The landing point is a fixed step, never "whenever the worker is done", so runs are
reproducible and data-parallel ranks (which hold identical replicated state and identical
all-reduced gradients) stay identical.

Approximations, all ZenFlow's: unimportant columns move once per window with a mean
gradient (and, with ``overlap_step``, see weights up to two windows old); moments keep their
values when a column changes sides, but the bias correction uses the side's step count
(device: every step; host: one per CPU update, warm-up steps included).
With ``topk_ratio`` 1.0, or ``update_interval`` 1 without ``overlap_step``, every element gets
exactly AdamW's update every step (the same fused kernel on the same values).

On a GPU the device's share of a step is the norm, the important columns' update, one
gather of the other columns' gradient and an asynchronous copy of it into pinned memory;
a worker thread adds it to the window's sum once the copy is done and runs the CPU update
(on gathered copies of those columns' host state) after the window's last addition.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from megatron_snake.errors import FlagError
from megatron_snake.optim.adamw import (STATES, HostAdamW, check_clip_grad, clip_coefficient,
                                        fused_adamw_, megatron_param_groups)
from megatron_snake.optim import host_kernel
from megatron_snake.optim.cpu_threads import budgeted_worker, check_optimizer_threads
from megatron_snake.optim.dp_shards import DataParallel
from megatron_snake.optim.unit_params import no_weight_decay
from megatron_snake.optim.zenflow_select import complement, select_columns


@dataclass(frozen=True)
class ZenFlowSettings:
    """``--snake-zenflow-<field>``: DeepSpeed's ZenFlow defaults for topk_ratio, fixed
    intervals where DeepSpeed says "auto". Validates itself; the flag check builds it."""

    topk_ratio: float = 0.1
    select_interval: int = 100
    update_interval: int = 4
    full_warmup_steps: int = 0
    overlap_step: bool = False

    def __post_init__(self):
        if not 0.0 < self.topk_ratio <= 1.0:
            raise FlagError(f"--snake-zenflow-topk-ratio must be in (0, 1], got "
                            f"{self.topk_ratio}")
        if self.update_interval < 1:
            raise FlagError(f"--snake-zenflow-update-interval must be >= 1, got "
                            f"{self.update_interval}")
        if self.select_interval < self.update_interval:
            raise FlagError(f"--snake-zenflow-select-interval ({self.select_interval}) must "
                            f"be >= --snake-zenflow-update-interval ({self.update_interval}): "
                            "columns are re-selected only between CPU updates")
        if self.full_warmup_steps < 0:
            raise FlagError(f"--snake-zenflow-full-warmup-steps must be >= 0, got "
                            f"{self.full_warmup_steps}")


@dataclass
class _Param:
    """One parameter seen as ``[rows, cols]`` (non-2-D ones as ``[1, numel]``, all columns
    always important), its host state and, while selected, its device state."""

    name: str
    param: torch.nn.Parameter
    decay: bool
    always: bool                      # not 2-D: every column is important
    master: torch.Tensor              # host, fp32 [rows, cols]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    idx: torch.Tensor | None = None   # device: important columns
    rest: torch.Tensor | None = None  # device: the other columns
    rest_cpu: torch.Tensor | None = None
    dev: dict = field(default_factory=dict)  # device master / exp_avg / exp_avg_sq [rows, k]
    # Host, [rows, len(rest)]: the window's gradient sum of the other columns, the other
    # buffer (the CPU update zeroes it), and the update's new weights waiting to land.
    acc: torch.Tensor | None = None
    spare: torch.Tensor | None = None
    landing: torch.Tensor | None = None

    @property
    def partial(self) -> bool:
        """Whether some columns are left to the CPU."""
        return self.rest is not None and self.rest.numel() > 0

    @property
    def working(self) -> torch.Tensor:
        return self.param.data.view(self.master.shape)

    def grad(self) -> torch.Tensor:
        g = getattr(self.param, "main_grad", None)  # Megatron DDP's fp32 buffer
        return (self.param.grad if g is None else g).view(self.master.shape)


@dataclass
class Traffic:
    """Bytes between host and device and time the caller blocked on CPU work."""

    d2h: int = 0
    h2d: int = 0
    cpu_wait_s: float = 0.0


def _host_empty(shape, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32, pin_memory=pin)


class ZenFlowAdamW(HostAdamW):
    """AdamW split by gradient importance. Drives like Megatron's optimizer:
    ``zero_grad``, ``step() -> (ok, grad_norm, None)``, ``param_groups`` for Megatron's
    scheduler, ``state_dict``/``load_state_dict``; plus ``flush``/``close`` at the end."""

    def __init__(self, named_params, *, lr: float, weight_decay: float, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8, clip_grad: float = 0.0,
                 settings: ZenFlowSettings | None = None,
                 dp: DataParallel = DataParallel(), threads: int | None = None):
        """``threads``: the CPU update's threads (default:
        ``cpu_threads.default_optimizer_threads``)."""
        check_clip_grad(clip_grad)
        self.settings, self.dp = settings or ZenFlowSettings(), dp
        self.beta1, self.beta2, self.eps, self.clip_grad = beta1, beta2, eps, clip_grad
        self.param_groups = megatron_param_groups(lr, weight_decay)
        self.params: list[_Param] = []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            self.device = p.device
            pin = p.device.type == "cuda"  # pinned: asynchronous copies to and from the GPU
            shape = tuple(p.shape) if p.dim() == 2 else (1, p.numel())
            master = _host_empty(shape, pin)
            master.copy_(p.detach().reshape(shape))
            self.params.append(_Param(name, p, not no_weight_decay(name, p), p.dim() != 2,
                                      master, _host_empty(shape, pin), _host_empty(shape, pin)))
        self.pin = self.device.type == "cuda"
        # the other columns' gradients leave the device on their own stream, so the copies
        # never queue in front of the next forward's kernels
        self._copy_stream = torch.cuda.Stream(self.device) if self.pin else None
        self._step_tensors: dict = {}  # device -> (step, 0-d tensor): one per step, not per param
        self.iteration = 0      # completed steps: the device side's AdamW step count
        self.host_step = 0      # AdamW steps the host state has taken
        self.window = 0         # steps accumulated since the last CPU update started
        self.selected_at: int | None = None
        self.pending_since: int | None = None  # step whose CPU update is in flight
        self._pending: Future | None = None
        self.threads = check_optimizer_threads(threads)
        self._worker = budgeted_worker(self.threads, "zenflow-adamw")
        self.traffic = Traffic()

    # --- the interface the loop drives ------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:  # Megatron's DDP zeroes main_grad itself (zero_grad_buffer)
            p.param.grad = None

    @torch.no_grad()
    def step(self):
        grads = [p.grad() for p in self.params]
        norm, coef, coef_value = self._clip(grads)
        self.iteration += 1
        if self.iteration <= self.settings.full_warmup_steps:
            self._exact_host_step(grads, coef)
            return True, norm, None
        if self.window == 0 and (self.selected_at is None or self.iteration - self.selected_at
                                 >= self.settings.select_interval):
            self._land()  # a selection moves state: nothing may be in flight
            self._select(grads)
        self._device_step(grads, coef)
        self._accumulate(grads, coef_value)
        self.window += 1
        if self.window == self.settings.update_interval:
            self._land()  # overlap: the update started one window ago
            self._start_cpu_update()
            if not self.settings.overlap_step:
                self._land()
        return True, norm, None

    def flush(self) -> None:
        """Land the update in flight and apply a partial window: the end of training."""
        self._land()
        if self.window:
            self._start_cpu_update()
            self._land()

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    # --- pieces of a step ------------------------------------------------------------------
    def _clip(self, grads):
        """torch.nn.utils.clip_grad_norm_'s arithmetic: per-parameter norms, then the norm
        of those, clip coefficient clamped to 1 (applied even when it is 1, as torch does).
        Returns (norm, coefficient on the device or None, coefficient as a number or None),
        the two numbers read in one host synchronisation."""
        norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        total = torch.linalg.vector_norm(norms)
        if self.clip_grad == 0:
            return total.item(), None, None
        coef = clip_coefficient(self.clip_grad, total)
        norm, coef_value = torch.stack([total, coef]).tolist()
        return norm, coef, coef_value

    def _hyper(self, p: _Param):
        group = self.param_groups[0]
        return dict(lr=group["lr"], beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                    weight_decay=group["weight_decay"] if p.decay else 0.0)

    def _step_tensor(self, step: int, device: torch.device) -> torch.Tensor:
        """The fused kernel's step count on ``device``: made once per step (torch.full is a
        fill kernel on a GPU; torch.tensor would be a blocking host-to-device copy)."""
        cached = self._step_tensors.get(device)
        if cached is None or cached[0] != step:
            cached = (step, torch.full((), float(step), dtype=torch.float32, device=device))
            self._step_tensors[device] = cached
        return cached[1]

    def _adamw(self, p: _Param, state: dict, grad: torch.Tensor, step: int, hyper=None):
        hyper = hyper or self._hyper(p)
        if grad.device.type != "cpu":   # the selected columns, on the device
            fused_adamw_([state["master"]], [grad], [state["exp_avg"]],
                         [state["exp_avg_sq"]], self._step_tensor(step, grad.device), **hyper)
            return
        # on the host: the offloaded AdamW's one-pass kernel (the same bits as torch's)
        flat = {name: t.view(-1) for name, t in state.items()}   # contiguous: views
        host_kernel.adamw_update(
            [host_kernel.Segment(grad.view(-1), flat["master"], flat["exp_avg"],
                                 flat["exp_avg_sq"])],
            step=step, threads=self.threads, **hyper)

    def _host_state(self, p: _Param) -> dict:
        return {name: getattr(p, name) for name in STATES}

    def _exact_host_step(self, grads, coef) -> None:
        """Warm-up: exact offloaded AdamW of every element (ZeRO-Offload)."""
        self.host_step = self.iteration
        start = time.perf_counter()
        coef = None if coef is None else coef.cpu()
        for p, g in zip(self.params, grads):
            host = g.float().to("cpu", copy=True)
            self.traffic.d2h += host.numel() * 4
            if coef is not None:
                host.mul_(coef)
            self._adamw(p, self._host_state(p), host, self.host_step)
            p.working.copy_(p.master)
            self.traffic.h2d += p.param.numel() * p.param.element_size()
        self.traffic.cpu_wait_s += time.perf_counter() - start

    def _select(self, grads) -> None:
        """Move the old selection's state back to the host, choose columns from this step's
        gradient, move their state to the device. Nothing is in flight (window start)."""
        for p, g in zip(self.params, grads):
            if p.always and p.dev:
                continue  # all columns, always: nothing changes
            if p.dev:
                cols = p.idx.cpu()
                for name in STATES:
                    getattr(p, name).index_copy_(1, cols, p.dev[name].cpu())
                    self.traffic.d2h += p.dev[name].numel() * 4
            if p.always:
                p.idx = torch.arange(p.master.shape[1], device=self.device)
            else:
                p.idx = select_columns(g, self.settings.topk_ratio, self.dp.group, self.dp.size)
            p.rest = complement(p.idx, p.master.shape[1])
            p.rest_cpu = p.rest.cpu()
            cols = p.idx.cpu()
            for name in STATES:
                p.dev[name] = getattr(p, name).index_select(1, cols).to(self.device)
                self.traffic.h2d += p.dev[name].numel() * 4
            shape = (p.master.shape[0], p.rest.numel())
            p.acc, p.spare = torch.zeros(shape), torch.zeros(shape)
        self.selected_at = self.iteration

    def _device_step(self, grads, coef) -> None:
        for p, g in zip(self.params, grads):
            if p.always:  # every column: no gather or scatter
                gi = g.float() * coef if coef is not None else g.float().clone()
                self._adamw(p, p.dev, gi, self.iteration)
                p.working.copy_(p.dev["master"])
                continue
            gi = g.float().index_select(1, p.idx)  # a copy: the caller's buffer is not touched
            if coef is not None:
                gi.mul_(coef)
            self._adamw(p, p.dev, gi, self.iteration)
            p.working.index_copy_(1, p.idx, p.dev["master"].to(p.param.dtype))

    def _accumulate(self, grads, coef_value) -> None:
        """The other columns' gradients leave the device now: gathered on the compute
        stream, copied into pinned memory on a side stream; the worker adds them to the
        window's sum, in order, once the copies are done, so the device waits for neither."""
        gathered = [(p, g.float().index_select(1, p.rest))
                    for p, g in zip(self.params, grads) if p.partial]
        if not gathered:
            return
        done = None
        if self.pin:
            gathered_event = torch.cuda.Event()
            gathered_event.record()
            self._copy_stream.wait_event(gathered_event)
        with torch.cuda.stream(self._copy_stream) if self.pin else contextlib.nullcontext():
            moved = []
            for p, gu in gathered:
                host = gu
                if self.pin:
                    host = torch.empty(gu.shape, dtype=gu.dtype, pin_memory=True)
                    host.copy_(gu, non_blocking=True)
                    gu.record_stream(self._copy_stream)  # not reused before the copy ran
                moved.append((p.acc, host))
                self.traffic.d2h += gu.numel() * 4
            if self.pin:
                done = torch.cuda.Event(blocking=True)  # the worker waits without spinning
                done.record()
        self._worker.submit(self._add, moved, done, coef_value)

    @staticmethod
    def _add(moved, done, scale) -> None:
        if done is not None:
            done.synchronize()
        for acc, host in moved:
            # acc + scale * g: the clipped gradient, rounded as g * coef is (fused multiply-add).
            acc.add_(host) if scale is None else acc.add_(host, alpha=scale)

    def _start_cpu_update(self) -> None:
        """Hand the window's sums to the CPU AdamW (queued behind the window's additions)."""
        steps, self.window = self.window, 0
        todo = [(p, p.acc, self._hyper(p)) for p in self.params if p.partial]
        if not todo:
            return
        for p, _, _ in todo:  # the next window adds into the other buffer
            p.acc, p.spare = p.spare, p.acc
        self.host_step += 1
        self.pending_since = self.iteration
        self._pending = self._worker.submit(self._cpu_update, todo, steps, self.host_step)

    def _cpu_update(self, todo, steps: int, host_step: int) -> None:
        """AdamW on the other columns' host state with the window's mean gradient, then
        their new working weights, ready to land."""
        for p, acc, hyper in todo:
            if steps > 1:
                acc.mul_(1.0 / steps)
            state = {name: getattr(p, name).index_select(1, p.rest_cpu) for name in STATES}
            self._adamw(p, state, acc, host_step, hyper)
            for name in STATES:
                getattr(p, name).index_copy_(1, p.rest_cpu, state[name])
            p.landing = self._to_land(p, state["master"])
            acc.zero_()  # ready to be the next window's buffer

    def _to_land(self, p: _Param, master_cols: torch.Tensor) -> torch.Tensor:
        out = torch.empty(master_cols.shape, dtype=p.param.dtype, pin_memory=self.pin)
        return out.copy_(master_cols)

    def _land(self) -> None:
        """Wait for the CPU update in flight and refresh the working weights it changed."""
        if self._pending is None:
            return
        start = time.perf_counter()
        self._pending.result()
        self.traffic.cpu_wait_s += time.perf_counter() - start
        self._pending, self.pending_since = None, None
        for p in self.params:
            if p.landing is None:
                continue
            p.working.index_copy_(1, p.rest, p.landing.to(self.device, non_blocking=True))
            self.traffic.h2d += p.landing.numel() * p.landing.element_size()
            p.landing = None

    def _drain(self) -> None:
        """Wait until the worker has done everything queued (additions, update)."""
        self._worker.submit(lambda: None).result()

    # --- reporting ---------------------------------------------------------------------------
    def selected_fraction(self) -> float:
        """Fraction of 2-D weight elements updated on the device every step."""
        total = sum(p.master.numel() for p in self.params if not p.always)
        if self.selected_at is None or not total:
            return 1.0  # warm-up: every element, exactly
        return sum(p.master.shape[0] * p.idx.numel() for p in self.params
                   if not p.always) / total

    def pending_age(self) -> int:
        """Steps since the CPU update in flight started (0: none in flight)."""
        return 0 if self.pending_since is None else self.iteration - self.pending_since

    def log_fields(self) -> str:
        return (f"zenflow selected: {self.selected_fraction():.3f} | "
                f"zenflow pending age: {self.pending_age()}")

    def summary(self) -> str:
        s = self.settings
        host = sum(3 * p.master.numel() * 4 for p in self.params) / 2**20
        return (f"> ZenFlow APPROXIMATE mode (--snake-zenflow, not exact AdamW): the top "
                f"{s.topk_ratio:.1%} gradient columns of every 2-D weight (re-selected every "
                f"{s.select_interval} steps) and all 1-D parameters are updated at once on "
                f"{self.device}; the rest accumulate in host memory and the CPU AdamW applies "
                f"them every {s.update_interval} steps on {self.threads} CPU thread(s), "
                + ("overlapped with the next window's compute" if s.overlap_step
                   else "synchronously")
                + (f"; the first {s.full_warmup_steps} steps are exact" if s.full_warmup_steps
                   else "")
                + f"; master weights + moments {host:.1f} MiB in host memory")

    # --- checkpoints -------------------------------------------------------------------------
    def reload_model_params(self) -> None:
        """The model's weights changed under a fresh optimizer (--load --no-load-optim):
        master weights from them again. Only before the first step."""
        if self.iteration:
            raise RuntimeError("reload_model_params after ZenFlow steps were taken")
        for p in self.params:
            p.master.copy_(p.param.detach().reshape(p.master.shape))

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: host state, accumulators, the device
        selection and its state, the counters. An update in flight is waited for (its result
        is in the host master) but not landed: it lands at its step after the resume too."""
        self._drain()
        params = {}
        for p in self.params:
            entry = {name: getattr(p, name).clone() for name in STATES}
            if p.acc is not None:
                entry["acc"] = p.acc.clone()
            if p.dev:
                entry["idx"] = p.idx.cpu()
                entry.update({f"dev_{n}": t.cpu() for n, t in p.dev.items()})
            params[p.name] = entry
        return {"iteration": self.iteration, "host_step": self.host_step,
                "window": self.window, "selected_at": self.selected_at,
                "pending_since": self.pending_since,
                "param_groups": [dict(g) for g in self.param_groups], "params": params}

    def load_state_dict(self, state: dict) -> None:
        names = {p.name for p in self.params}
        if set(state["params"]) != names:
            raise KeyError("checkpoint ZenFlow state does not match the model's parameters "
                           f"(missing {sorted(names - set(state['params']))}, unexpected "
                           f"{sorted(set(state['params']) - names)})")
        self._land()
        for key in ("iteration", "host_step", "window", "selected_at", "pending_since"):
            setattr(self, key, state[key])
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        for p in self.params:
            entry = state["params"][p.name]
            for name in STATES:
                getattr(p, name).copy_(entry[name])
            p.dev, p.acc, p.spare, p.landing = {}, None, None, None
            if "idx" in entry:
                p.idx = entry["idx"].to(self.device)
                p.rest = complement(p.idx, p.master.shape[1])
                p.rest_cpu = p.rest.cpu()
                p.dev = {n: entry[f"dev_{n}"].to(self.device) for n in STATES}
                p.acc, p.spare = entry["acc"].clone(), torch.zeros_like(entry["acc"])
                if self.pending_since is not None and p.partial:
                    p.landing = self._to_land(p, p.master.index_select(1, p.rest_cpu))
        if self.pending_since is not None:  # its result is already in the host master
            self._pending = Future()
            self._pending.set_result(None)
