"""The offloaded AdamW's checkpoint state: what a checkpoint saves of it and how it is put
back, one layout at a time (the model is never whole in memory).

A checkpoint holds this rank's shard of each layout's master weights and both moments in
the dtypes Megatron-Core's distributed optimizer writes (``Precision.checkpoint_dtype``),
the step count, the hyper-parameters and, with fp16, the loss scaler's state.
"""

from __future__ import annotations

import torch

from megatron_snake.optim.adamw import STATES
from megatron_snake.optim.parts import PARTS
from megatron_snake.optim.precision import REMAINDER, join_flat, split_flat


class CheckpointState:
    """The checkpoint methods of ``OffloadedAdamW`` (a mixin: they read its ``store``,
    ``states``, ``layouts``, ``dp``, ``precision``, ``tier`` and step count, and apply its
    pending updates first)."""

    def state_dict(self, layouts: bool = True) -> dict:
        """The step count and the hyper-parameters (and the loss scaler's state), and with
        ``layouts`` this rank's shard of every layout's master weights and moments: what a
        checkpoint needs to resume exactly. The layouts together are this rank's whole
        optimizer shard: a checkpoint takes ``layouts=False`` and reads them one at a time
        with ``layout_state``."""
        self.flush()
        state = {"iteration": self.iteration, "alpha": self.alpha,
                 "param_groups": [dict(g) for g in self.param_groups]}
        if self.grad_scaler is not None:  # fp16: the loss scale and its growth/backoff counters
            state["grad_scaler"] = self.grad_scaler.state_dict()
        if layouts:
            state["layouts"] = {key: self.layout_state(key) for key in self.layouts}
        return state

    def layout_state(self, key, names=STATES) -> dict:
        """This rank's shard of layout ``key``'s master weights and both moments ({name:
        flat shard}; ``names`` of them), read back from their tier once its pending update
        is applied, as a checkpoint holds them (``Precision.checkpoint_dtype``: what
        Megatron-Core's distributed optimizer writes): the moments and an fp16 master in
        fp32, unscaled; under remainders the master's int16 remainders (they pair with the
        working weights saved beside them)."""
        self.finish_update(key)
        lay, p = self.layouts[key], self.precision
        start, end, _ = self.dp.shard(lay.numel)
        raw = {name: torch.empty(end - start, dtype=p.dtype(name)) for name in names}
        parts = [(part, lo, hi) for part, (lo, hi) in zip(PARTS, self.states.bounds(lay)) if hi > lo]
        handles = [self.store.get((name, key, part), out=raw[name][lo - start:hi - start])
                   for name in names for part, lo, hi in parts]
        for handle in handles:
            handle.wait()
        state = {}
        for name in names:
            if p.dtype(name) in (torch.float32, REMAINDER):
                state[name] = raw[name]
                continue
            state[name] = torch.empty(end - start, dtype=torch.float32)
            for part, lo, hi in parts:
                self.states.decode(name, key, part, raw[name][lo - start:hi - start],
                             state[name][lo - start:hi - start])
        return state

    def native_master(self, master: torch.Tensor, weights: torch.Tensor | None):
        """A checkpoint's master weights (one shard: fp32 values, or the int16 remainders of
        ``weights``, the bf16 working weights saved with them) as ``load_layout_state``
        takes them here, and the working weights that must go with them when they are not
        ``weights``: (master, new weights or None). Remainders into a run without them are
        joined with their weights (exact); fp32 masters into a run with them are split
        (exact), the working weights becoming the split's high halves (they differ from
        the saved ones only where a master lies exactly halfway between two bf16 values)."""
        remainders = master.dtype == REMAINDER
        if remainders and (weights is None or weights.dtype != torch.bfloat16):
            raise ValueError("master-weight remainders need the bf16 working weights saved "
                             "with them")
        if self.precision.remainders:
            if remainders:
                return master, None
            hi, rem = split_flat(master)
            same = weights is not None and weights.dtype == torch.bfloat16 and \
                torch.equal(hi.view(torch.int16), weights.reshape(-1).view(torch.int16))
            return rem, None if same else hi
        if remainders:
            return join_flat(weights, master), None
        return master.to(torch.float32), None

    def load_layout_state(self, key, state: dict) -> list:
        """Put ``layout_state(key)``'s shards back into the store (this rank's shard of the
        same layout): the moments as fp32 values (rounded to their dtype here, Transformer
        Engine's ``set_scaled_state``), the master as ``native_master`` gives it. Returns
        the puts' handles: ``state`` is read until they are done."""
        lay = self.layouts[key]
        start, end, _ = self.dp.shard(lay.numel)
        for name in STATES:
            if tuple(state[name].shape) != (end - start,):
                raise ValueError(f"checkpoint optimizer state {name} of unit {key} has shape "
                                 f"{tuple(state[name].shape)}, this rank's shard "
                                 f"{(end - start,)}")
        if (state["master"].dtype == REMAINDER) != self.precision.remainders:
            raise ValueError(f"master weights of unit {key} are {state['master'].dtype}: "
                             "convert them with native_master first")
        self.finish_update(key)
        handles = []
        for name in STATES:
            shard = state[name]
            for part, (lo, hi) in zip(PARTS, self.states.bounds(lay)):
                values = self.states.encode(name, key, part, shard[lo - start:hi - start])
                handles.append(self.store.put((name, key, part), values,
                                              tier=self.tier_of(key), kind="optim"))
        return handles

    def set_master_weights(self, key, flat: torch.Tensor) -> None:
        """Master weights of layout ``key`` from ``flat`` (the whole layout, any dtype and
        device): this rank's parts, in their stored form (under remainders: zero
        remainders of bf16 ``flat``, whose working-weight records the caller keeps). Before
        the first step only (--no-load-optim)."""
        if self.iteration or self._hyper is not None:
            raise RuntimeError("master weights can be replaced only before the first step")
        full = flat.detach().reshape(-1).to("cpu", torch.float32)
        for part, (lo, hi) in zip(PARTS, self.states.bounds(self.layouts[key])):
            values = split_flat(full[lo:hi])[1] if self.precision.remainders else full[lo:hi]
            self.store.put(("master", key, part), self.states.encode("master", key, part, values),
                           tier=self.tier_of(key), kind="optim")

    def load_state_dict(self, state: dict) -> None:
        """``state_dict()``'s state back; without "layouts" (a checkpoint loads them one at
        a time with ``load_layout_state``) only the step count and hyper-parameters."""
        if "layouts" in state and set(state["layouts"]) != set(self.layouts):
            raise KeyError("checkpoint optimizer state does not match the model's units "
                           f"({sorted(map(str, state['layouts']))} vs "
                           f"{sorted(map(str, self.layouts))}); was it saved with another "
                           "--snake-checkpoint-interval?")
        self.flush()
        self.iteration = state["iteration"]
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
            self._read_loss_scale()
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        for key, saved in state.get("layouts", {}).items():
            for handle in self.load_layout_state(key, saved):
                handle.wait()
        self.store.synchronize()
