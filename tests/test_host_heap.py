"""The process heap's policy (storage/host_heap.py): activation-sized blocks are reused
rather than mapped and faulted in afresh, the heap's free pages still go back to the OS
between units, and the emulated device keeps everything. Each case runs in a fresh process:
glibc's settings are process-wide. Page faults are the kernel's count (ru_minflt)."""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

PRELUDE = """
import json, resource, torch
from megatron_snake.storage import host_heap

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def faults_of_reuse(numel, times=40):
    for _ in range(10):                     # the first uses grow the heap: they fault in
        torch.ones(numel)
    before = faults()
    for _ in range(times):
        x = torch.ones(numel)               # written: every fresh page faults
        del x
    return (faults() - before) / times
"""


def run(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PAGES_PER_4MIB = (4 << 20) // 4096


@pytest.mark.parametrize("threshold, reused", [("", True), ("1 << 20", False)])
def test_activation_sized_blocks_are_reused_not_faulted_in_again(threshold, reused):
    """4 MiB blocks (fp32 activations) are reused under the run's policy; mapping every
    block of 1 MiB or more (the policy before) faults each one in afresh, every time:
    the measurement can tell the two apart."""
    out = run(f"""
        assert host_heap.bound_host_heap({threshold})
        print(json.dumps({{"faults": faults_of_reuse(1 << 20)}}))
    """)
    if reused:
        assert out["faults"] <= 0.02 * PAGES_PER_4MIB, out
    else:
        assert out["faults"] >= 0.9 * PAGES_PER_4MIB, out


def test_the_heap_gives_back_freed_pages_once_they_add_up():
    out = run("""
        assert host_heap.bound_host_heap()
        host_heap.release_free_heap()       # a step ends: the low-water mark
        blocks = [torch.ones(2 << 20) for _ in range(41)]   # 328 MiB, 8 MiB blocks
        # the last block, carved from the heap's top after the others, keeps them off the
        # top (a small guard could land in a free fragment lower down the heap, and the
        # blocks freed below it would join the top and go back to the OS at once)
        guard = blocks.pop()
        held = host_heap.resident_bytes()
        del blocks                          # freed into the heap, still resident
        kept = host_heap.resident_bytes()
        small_growth = host_heap.trim_host_heap(retain_bytes=1 << 30)
        trimmed = host_heap.trim_host_heap(retain_bytes=64 << 20)
        after = host_heap.resident_bytes()
        again = host_heap.trim_host_heap(retain_bytes=64 << 20)
        print(json.dumps({"held": held, "kept": kept, "after": after, "trimmed": trimmed,
                          "small_growth": small_growth, "again": again}))
    """)
    assert out["kept"] >= out["held"] - (16 << 20), out   # freeing alone kept them
    assert out["small_growth"] is False and out["trimmed"] is True, out
    assert out["kept"] - out["after"] >= 256 << 20, out   # trimming gave them back
    assert out["again"] is False, out                      # nothing new: no second trim


def test_the_emulated_device_keeps_even_large_blocks():
    out = run("""
        assert host_heap.bound_host_heap()
        mapped = faults_of_reuse(16 << 20, times=5)   # 64 MiB: above the ceiling, mapped
        assert host_heap.keep_freed_host_memory()
        faults_of_reuse(16 << 20, times=5)  # the first blocks from the heap fault in
        kept = faults_of_reuse(16 << 20, times=5)
        host_heap.release_free_heap()
        after_release = faults_of_reuse(16 << 20, times=5)
        print(json.dumps({"mapped": mapped, "kept": kept, "after_release": after_release,
                          "trims": host_heap.trim_host_heap(retain_bytes=0)}))
    """)
    pages = (64 << 20) // 4096
    assert out["mapped"] >= 0.9 * pages, out
    assert out["kept"] <= 0.02 * pages and out["after_release"] <= 0.02 * pages, out
    assert out["trims"] is False, out
