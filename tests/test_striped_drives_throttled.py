"""The drive tier striped over two real (emulated) drives: loop devices throttled to 100
MB/s each by the blkio cgroup (tools/emulated_drives.py). Both drives carry the traffic,
in about equal shares as their block layer counts it, and the data reads back bit-exact.
Skips, saying why, where the machine cannot emulate drives (not root, no loop devices, no
cgroup v1 blkio controller)."""

import os
import sys

import pytest
import torch

from megatron_snake.storage import TensorStore

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from emulated_drives import EmulatedDrives, why_not  # noqa: E402

pytestmark = pytest.mark.skipif(why_not() is not None, reason=str(why_not()))

RECORD = 48 << 20


def test_two_throttled_drives_both_carry_the_traffic_and_the_data_reads_back(tmp_path):
    gen = torch.Generator().manual_seed(0)
    values = [torch.randint(0, 256, (RECORD,), dtype=torch.uint8, generator=gen)
              for _ in range(3)]
    total = len(values) * RECORD
    drives = EmulatedDrives(2, rate=100e6, size=1 << 30, parent=str(tmp_path))
    with drives as dirs:
        with TensorStore(dirs, host_memory_limit=256 << 20, buffer_bytes=8 << 20) as store:
            assert "over 2 drives" in store.summary()
            for h in [store.put(i, v, tier="nvme") for i, v in enumerate(values)]:
                h.wait()
            written = drives.served_bytes()
            got = [h.wait() for h in [store.get(i) for i in range(len(values))]]
            assert all(torch.equal(g, v) for g, v in zip(got, values))
            served = drives.served_bytes()
    for dev in drives.devices:
        # each drive wrote and read close to half (records, headers, the files' headers)
        assert 0.4 * total < written[dev][1] < 0.6 * total + (8 << 20), (dev, written)
        assert 0.4 * total < served[dev][0] < 0.6 * total + (8 << 20), (dev, served)
