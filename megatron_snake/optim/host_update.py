"""One part's update: the clip, AdamW and the new working weights, on the state the update
borrowed from the store (``optim/update_worker.py`` lends it and takes it back).

On the host it is one call of ``optim/host_kernel.py``: the native kernel (one pass over
each element: the gradient, master weights and moments read once, the new state and the
new working weights written once, in their stored dtypes), or torch's passes with the same
bits. The lent records come as 1-D pieces cut where their host buffers end, and records of
other dtypes are cut at other elements, so the part is cut into *segments* contiguous in
every stream, and at each parameter's piece (its weight decay, a scaled state's scale).
torch's fused AdamW runs a tensor in lanes from its first element and its last (numel mod
lanes) elements on a scalar path; the reference runs each parameter piece as one tensor, so
each segment says how many of its elements lie before its piece's tail
(``host_kernel.vector_count``) and every bit is the reference's (docs/design.md, invariant 1).
Weight decay follows Megatron (none on biases and 1-D parameters).

A layout of the device share (state on the compute device) is updated on the device with
torch's fused AdamW, one tensor per parameter piece; on an emulated device
(``emulated_device``, a benchmark's) that update is time on the device's clock.
"""

from __future__ import annotations

import bisect
import itertools
import time

import torch

import megatron_snake.emulated_device as emulated_device
import megatron_snake.timeline as timeline
from megatron_snake.optim import host_kernel
from megatron_snake.optim.adamw import STATES, fused_adamw_
from megatron_snake.optim.parts import PartStates
from megatron_snake.optim.precision import SCALED


class _Flat:
    """Element access to a record lent as 1-D pieces (cut where its host buffers end)."""

    def __init__(self, pieces: list[torch.Tensor]):
        self.pieces = [p for p in pieces if p.numel()]
        self.starts = list(itertools.accumulate([0] + [p.numel() for p in self.pieces]))

    def cuts(self) -> list[int]:
        return self.starts[1:-1]

    def view(self, a: int, b: int) -> torch.Tensor:
        """Elements [a, b), which one piece holds (the segments are cut at every piece's
        edge), as a view."""
        i = bisect.bisect_right(self.starts, a) - 1
        return self.pieces[i][a - self.starts[i]:b - self.starts[i]]


class HostUpdate:
    """The arithmetic of one part's update (``run``), for the parts of ``states``, on
    ``threads`` CPU threads (the native kernel's own)."""

    def __init__(self, states: PartStates, *, beta1: float, beta2: float, eps: float,
                 threads: int = 1, traffic=None):
        self.states, self.precision = states, states.precision
        self.traffic = traffic   # the store's HostTraffic: the host bytes it reads and writes
        self.beta1, self.beta2, self.eps, self.threads = beta1, beta2, eps, threads
        # how bf16 working weights are rounded from fp32 masters: "even", torch's cast (as
        # Megatron copies its masters into bf16 parameters); under remainders always "te",
        # Transformer Engine's split (a test compares the two modes with "te" here)
        self.weights_rounding = "even"

    def run(self, key, part: str, hyper, clip_coef, lent: dict, phase,
            out: dict | None = None, weights_out: list | None = None):
        """Update part ``part`` of layout ``key`` in the lent records ``lent`` ({state:
        1-D pieces}; "w" too under remainders: the masters' high halves) with
        ``hyper`` (StepHyper) and the clip coefficient (None: no clip), timing its phases
        with ``phase(name, since)``. ``out``: write the new master weights and moments there
        ({state: 1-D pieces of records of the same dtypes and sizes}, a scaled state's
        scales as the part's next ones) and leave ``lent`` as it is. ``weights_out``: 1-D
        pieces the new working weights are written into (in the training dtype; under
        remainders they may be ``lent["w"]`` itself: each old weight is read, then replaced).

        Returns the new working weights to publish, as 1-D pieces: None where they went to
        ``weights_out``; the new master itself where the weights are fp32 (no copy of their
        own); else a new tensor."""
        t = time.perf_counter()
        if lent["master"] and lent["master"][0].device.type != "cpu":
            weights = self._on_device(key, part, hyper, clip_coef, lent)
            phase("adamw", t)
            return weights
        if self._on_emulated_device(lent, clip_coef):
            phase("adamw", t)
            return lent["master"]
        p = self.precision
        out = out or {}
        numel = sum(x.numel() for x in lent["master"])
        new_master = out.get("master", lent["master"])
        remainders = p.remainders
        own_weights = weights_out is None and p.params != torch.float32
        if own_weights:   # the new weights to publish
            weights_out = [torch.empty(numel, dtype=p.params)]
        segments = self._segments(key, part, lent, out, weights_out)
        scaled = [name for name in STATES if p.dtype(name) in SCALED]
        scales = {name: self.states.scales[(name, key, part)] for name in scaled}
        with timeline.span("host adamw", "cpu adamw", params=numel,
                           impl=host_kernel.implementation()):
            new = host_kernel.adamw_update(
                segments, lr=hyper.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                weight_decay=hyper.weight_decay, step=hyper.step, clip=clip_coef,
                scales=scales, weights_rounding="te" if remainders else self.weights_rounding,
                threads=self.threads)
        if self.traffic is not None:
            self.traffic.add("update", host_kernel.stream_bytes(segments, bool(scaled)))
        for name, values in new.items():
            self.states.set_scales(name, key, part, values, bool(out))
        phase("adamw", t)
        if own_weights:
            return weights_out
        return None if weights_out is not None else new_master

    def _segments(self, key, part: str, lent: dict, out: dict, weights_out) -> list:
        """The part's segments: cut at every stream's piece edges and at each parameter
        piece (``states.pieces``); each knows its piece, its decay and how many of its
        elements torch would run in lanes."""
        streams = {name: _Flat(lent[name]) for name in STATES + ("grad",)}
        streams.update({f"{name}_out": _Flat(out[name]) for name in out})
        if self.precision.remainders:
            streams["weights"] = _Flat(lent["w"])
        if weights_out is not None:
            streams["weights_out"] = _Flat(weights_out)
        pieces = self.states.pieces(key, part)
        cuts = sorted({c for f in streams.values() for c in f.cuts()}
                      | {a for a, _, _ in pieces})
        segments = []
        for index, (a, b, decay) in enumerate(pieces):
            edges = [a] + [c for c in cuts if a < c < b] + [b]
            for lo, hi in zip(edges, edges[1:]):
                views = {name: f.view(lo, hi) for name, f in streams.items()}
                segments.append(host_kernel.Segment(
                    **views, vector=host_kernel.vector_count(b - a, lo - a, hi - a),
                    piece=index, decay=decay))
        return segments

    def _on_device(self, key, part: str, hyper, clip_coef, lent: dict) -> list:
        """A part of the device share (fp32 states, each lent as one device tensor): torch's
        fused AdamW on the device, one tensor per parameter piece. Returns the new master
        (converted to the working dtype where it is published)."""
        (master,), (grad,), (m,), (v,) = (lent[name] for name in STATES[:1] + ("grad",)
                                          + STATES[1:])
        if clip_coef is not None:
            grad.mul_(clip_coef)
        step = torch.tensor(float(hyper.step), device=master.device)
        for decay in (True, False):
            views = [(master[a:b], grad[a:b], m[a:b], v[a:b])
                     for a, b, d in self.states.pieces(key, part) if d == decay]
            if views:
                fused_adamw_(*map(list, zip(*views)), step, lr=hyper.lr, beta1=self.beta1,
                             beta2=self.beta2, eps=self.eps,
                             weight_decay=hyper.weight_decay if decay else 0.0)
        return [master]

    @staticmethod
    def _on_emulated_device(lent: dict, clip_coef) -> bool:
        """A part of the device share on an emulated device (its state is host memory
        there, and the thread that runs the schedule updates it): the device's fused AdamW
        as time on its clock, the bytes ``_on_device``'s kernels stream (the clip's
        multiply, then the gradient read and the master and both moments read and
        written), the values left as they are. Whether it was."""
        numel = sum(x.numel() for x in lent["master"])
        nbytes = numel * (4 + 3 * 8 + (8 if clip_coef is not None else 0))
        span = emulated_device.memory_work(nbytes)
        if span is None:
            return False
        timeline.record("device adamw", "device", *span, thread="device",
                        seconds=span[1] - span[0], params=numel)
        return True

    @staticmethod
    def scratch_bytes() -> int:
        """Host memory an update holds besides its records: the torch path's fp32 chunk
        buffers (the native kernel holds none)."""
        return 4 * 4 * host_kernel.CHUNK_ELEMENTS
