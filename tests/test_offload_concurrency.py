"""Many concurrent puts/gets from several threads through a tiny host pool: data stays
exact, the pool never holds more than --snake-host-memory-limit, and callers at the limit
wait instead of failing (measured by the pool's own counters)."""

import threading
import time

import pytest
import torch

from megatron_snake.storage import HostMemoryError, TensorStore
from megatron_snake.storage.engine import native_available

BUF = 64 << 10
ENGINES = ["python"] + (["uring", "threads"] if native_available() else [])


@pytest.mark.parametrize("engine", ENGINES)
def test_many_threads_under_a_tiny_host_limit(engine, tmp_path):
    limit = 4 * BUF                                   # 4 buffers for 4 threads x 3-record tensors
    with TensorStore(tmp_path, host_memory_limit=limit, buffer_bytes=BUF, engine=engine,
                     workers=4, queue_depth=8) as s:
        errors = []

        def client(tid):
            gen = torch.Generator().manual_seed(tid)
            try:
                for i in range(25):
                    n = int(torch.randint(1, 3 * BUF // 4, (1,), generator=gen))
                    t = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=gen)
                    key = (tid, i)
                    s.put(key, t, tier="nvme").wait()
                    h = s.get(key)
                    if i % 3 == 0:
                        s.put((tid, i, "extra"), t, tier="nvme")   # left in flight on purpose
                    got = h.wait()
                    assert torch.equal(got, t), (tid, i)
                    s.delete(key)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        s.synchronize()
        assert not errors, errors[0]
        pool = s.pool
        assert pool.allocated_bytes <= limit              # the limit held
        assert pool.peak_in_use <= pool.count == 4
        assert pool.waits > 0                             # callers did hit the limit and waited
        assert pool.in_use == 0 and s.counters.queue_depth == 0
        for tid in range(4):
            for i in range(0, 25, 3):
                got = s.get((tid, i, "extra")).wait()
                assert got.dtype == torch.int32


def test_host_tier_waits_for_staging_buffers_then_succeeds(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=6 * BUF, buffer_bytes=BUF) as s:
        held = s.pool.acquire(5)                          # as if other I/O held 5 of 6 buffers
        timer = threading.Timer(0.3, s.pool.release, args=(held,))
        timer.start()
        t0 = time.perf_counter()
        t = torch.randn(2 * BUF // 4 - 100)               # needs 2 host buffers
        s.put("h", t, tier="host").wait()                  # waits, does not fail
        assert time.perf_counter() - t0 >= 0.25
        assert s.pool.waits >= 1 and s.pool.wait_seconds >= 0.2
        assert torch.equal(s.get("h").wait(), t)
        timer.join()


def test_host_tier_request_that_can_never_fit_fails_at_once(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=6 * BUF, buffer_bytes=BUF) as s:
        s.put("a", torch.zeros(3 * BUF // 4), tier="host").wait()    # 4 buffers resident
        with pytest.raises(HostMemoryError, match="--snake-host-memory-limit"):
            s.put("b", torch.zeros(2 * BUF // 4), tier="host").wait()
        s.evict("a", "nvme").wait()                        # frees the resident buffers
        s.put("b", torch.zeros(2 * BUF // 4), tier="host").wait()
        assert s.tiers("b") == ["host"]


def test_limit_below_two_buffers_is_refused(tmp_path):
    with pytest.raises(HostMemoryError, match="--snake-host-memory-limit"):
        TensorStore(tmp_path, host_memory_limit=BUF, buffer_bytes=BUF)
    assert not (tmp_path / "rank0").exists()             # nothing left behind


def test_swap_space_is_reused_not_grown(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=8 * BUF, buffer_bytes=BUF) as s:
        gen = torch.Generator().manual_seed(1)
        for i in range(60):
            n = int(torch.randint(1, 4 * BUF, (1,), generator=gen))
            s.put(("k", i % 3), torch.zeros(n, dtype=torch.uint8), tier="nvme")
        s.synchronize()
        f, = (d.files["misc"] for d in s._drive.drives)
        assert f.size <= (64 << 20) + 4096            # one growth step, never more
        for i in range(3):
            s.delete(("k", i)).wait()
        assert f.used == 0 and f._free == [] and f._end == 4096   # fully coalesced
