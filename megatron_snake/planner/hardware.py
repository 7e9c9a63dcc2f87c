"""The hardware profile the cost model predicts for: one node's rates and capacities.

A profile is a JSON object of the fields below (``tools/calibrate.py`` measures this machine;
``megatron_snake/planner/profiles/`` has typical nodes built from public figures). Rates are
bytes or parameters per second, capacities bytes. Drive figures are the node's total over
its drives (``drives`` of them); the node's GPUs share them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields

OPTIONAL_FIELDS = ("drives", "head_tflops", "io_compute_slowdown", "unit_visit_s", "device_tflops_alone",
                   "head_tflops_alone", "source")
PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    device_tflops: float          # achieved on a unit's matmuls (what a step gets, not peak)
    device_peak_tflops: float     # the datasheet's dense figure, for MFU
    unit_overhead_s: float        # host time of a one-layer unit's pass on one micro-batch
    #                               beside its FLOPs (Python, kernel launches, the store's
    #                               work for the unit input): a k-layer unit's is k times it
    device_memory: int
    pcie_Bps: float               # host<->device copies, one direction, per GPU
    drive_read_Bps: float         # the node's drives together
    drive_write_Bps: float
    drive_capacity: int
    host_memory: int              # the node's RAM
    host_copy_Bps: float          # a memory copy in host RAM (the store's host tier), per GPU
    cpu_adam_params_per_s: float  # the fused CPU AdamW, per GPU, on the update's threads
    #   (--snake-optimizer-threads: tools/calibrate.py measures at its default, half the cores)
    intra_node_Bps: float         # collective bus bandwidth between a node's GPUs
    inter_node_Bps: float         # per GPU, between nodes
    head_tflops: float | None = None   # achieved on the output layer with its loss
    #                                    (optional: device_tflops when not measured)
    io_compute_slowdown: float = 0.0   # the share of the compute's time the store's drive
    #                                    I/O takes from it while both run: a CPU device
    #                                    shares its cores with the store (a GPU: about 0)
    unit_visit_s: float = 0.0     # host time of one visit of a unit in a sweep beside its
    #                               passes (acquiring and releasing its weights, handing its
    #                               gradient and update on), the step boundary's share in it
    device_tflops_alone: float | None = None   # a layer, and the output layer, timed by
    head_tflops_alone: float | None = None     # themselves, for comparison where the rates
    #                               above were measured inside a real step (a CPU device,
    #                               whose cores the store and the AdamW share)
    source: str = ""              # how the figures were obtained
    drives: int = 1               # the node's drives, which the drive figures add up

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "source"):
                if not isinstance(value, str):
                    raise ValueError(f"hardware profile: {f.name} must be a string")
                continue
            if f.name == "drives":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"hardware profile {self.name!r}: drives must be a "
                                     f"whole number of drives, at least 1, got {value!r}")
                continue
            if f.name in ("head_tflops", "device_tflops_alone", "head_tflops_alone") and \
                    value is None:
                continue
            low_ok = f.name in ("unit_overhead_s", "io_compute_slowdown",
                                "unit_visit_s") and value == 0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or (value <= 0 and not low_ok):
                raise ValueError(f"hardware profile {self.name!r}: {f.name} must be a positive "
                                 f"number, got {value!r}")
        if self.io_compute_slowdown >= 1:
            raise ValueError(f"hardware profile {self.name!r}: io_compute_slowdown must be "
                             f"below 1 (a share of the compute's time), got "
                             f"{self.io_compute_slowdown!r}")
        if self.device_tflops > self.device_peak_tflops:
            raise ValueError(f"hardware profile {self.name!r}: device_tflops "
                             f"{self.device_tflops} is above device_peak_tflops "
                             f"{self.device_peak_tflops}")

    @classmethod
    def from_dict(cls, d: dict, origin: str = "hardware profile") -> "Hardware":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{origin}: unknown field(s) {unknown}; the fields are "
                             f"{sorted(known)}")
        missing = sorted(f.name for f in fields(cls)
                         if f.name not in d and f.name not in OPTIONAL_FIELDS)
        if missing:
            raise ValueError(f"{origin}: missing field(s) {missing}")
        return cls(**d)

    @classmethod
    def load(cls, path: str, flag: str = "--hardware") -> "Hardware":
        try:
            with open(path) as f:
                d = json.load(f)
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} {path}: not JSON ({exc})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{flag} {path}: expected a JSON object")
        return cls.from_dict(d, origin=f"{flag} {path}")

    @property
    def output_layer_tflops(self) -> float:
        return self.head_tflops or self.device_tflops

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> "Hardware":
        return Hardware.from_dict({**self.to_dict(), **changes})

    def with_drives(self, drives: int) -> "Hardware":
        """The same node with ``drives`` drives of the kind it has (each drive's rates and
        capacity are the node's over ``self.drives``): a study of drives per node."""
        if isinstance(drives, bool) or not isinstance(drives, int) or drives < 1:
            raise ValueError(f"drives must be a whole number, at least 1, got {drives!r}")
        k = drives / self.drives
        return self.with_(name=f"{self.name}; {drives} drives of its kind", drives=drives,
                          drive_read_Bps=self.drive_read_Bps * k,
                          drive_write_Bps=self.drive_write_Bps * k,
                          drive_capacity=int(self.drive_capacity * k))


def load_profile(name: str, flag: str = "--hardware") -> Hardware:
    """A profile from a JSON file, or a shipped one by name (``profiles/<name>.json``)."""
    path = name if os.path.exists(name) else os.path.join(PROFILES, f"{name}.json")
    if not os.path.exists(path):
        shipped = sorted(f[:-5] for f in os.listdir(PROFILES) if f.endswith(".json"))
        raise ValueError(f"{flag} {name}: no such file, nor a shipped profile "
                         f"({', '.join(shipped)})")
    return Hardware.load(path, flag)
