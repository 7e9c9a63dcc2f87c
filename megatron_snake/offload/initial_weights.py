"""A model bigger than memory, built one layer at a time.

Megatron-Core initialises each parameter when its module is built. ``InitialWeights.spill``
runs right after each decoder layer is built (and once more for the embedding and output
layer when the model is complete): it writes the layer's freshly initialised values to the
store and leaves each parameter a placeholder of its shape that holds one element (a
broadcast scalar: shapes and sizes stay right for the unit layouts, and the parameter stays
on its device, which ``param.data`` assignment requires), so the process never holds more
than about one layer. The construction itself is Megatron's, in Megatron's order, so
the initial weights are bit-identical to an in-memory build with the same seed.

The offloaded state then reads each layout's values back once (``flat``), to make the
optimizer's master weights and the unit weight records, and ``drop`` frees the records.
The shared (tied) parameters stay on the device for the whole run, so ``restore`` puts
their values back.
"""

from __future__ import annotations

import torch

from megatron_snake.optim.unit_params import FlatLayout

KIND = "weights"


class InitialWeights:
    def __init__(self, store, *, tier: str = "nvme"):
        self.store, self.tier = store, tier
        self._keys: dict[int, tuple] = {}   # id(parameter) -> its record's key
        self.nbytes = 0                      # held in the store now

    def spill(self, module: torch.nn.Module) -> None:
        """Move every parameter of ``module`` that still has values into the store."""
        writes = []
        for param in module.parameters():
            if id(param) in self._keys:
                continue
            key = ("initial", len(self._keys))
            self._keys[id(param)] = key
            writes.append(self.store.put(key, param.detach(), tier=self.tier, kind=KIND))
            self.nbytes += param.numel() * param.element_size()
            param.data = torch.zeros((), dtype=param.dtype,
                                     device=param.device).expand(param.shape)
        for write in writes:   # the values are freed only once written
            write.wait()

    def flat(self, layout: FlatLayout, *, dtype: torch.dtype, device="cpu") -> torch.Tensor:
        """``layout``'s initial values as one flat tensor (``FlatLayout.gather`` for
        parameters whose values live in the store)."""
        flat = torch.empty(layout.numel, dtype=dtype, device=device)
        for seg in layout.segments:
            part = flat[seg.offset:seg.offset + seg.numel]
            if id(seg.param) in self._keys:
                value = self.store.get(self._keys[id(seg.param)]).wait()
                part.copy_(value.reshape(-1))
            else:
                part.copy_(seg.param.detach().reshape(-1))
        return flat

    def restore(self, layout: FlatLayout, device: torch.device) -> None:
        """Give ``layout``'s parameters their values back, on ``device``."""
        for seg, value in zip(layout.segments, layout.views(
                self.flat(layout, dtype=layout.segments[0].param.dtype, device=device)
                if layout.segments else torch.empty(0))):
            seg.param.data = value

    def drop(self) -> None:
        """Delete the records: the offloaded state holds its own copies now."""
        for key in self._keys.values():
            self.store.delete(key)
        self._keys.clear()
        self.nbytes = 0
