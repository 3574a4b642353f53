"""Note [host allocations] (parallel/memory/host.py): with the thresholds a worker sets, a step's tensors are
reused from the heap step after step instead of being given back to the system and faulted in again."""
import subprocess
import sys

import pytest

# A fresh process allocating tensors and freeing them, as a step's activations come and go, 20 times; prints the
# minor page faults of those rounds, with a worker's setting or glibc's own. argv: the setting, the tensors'
# count and elements, the rounds before (warm-up).
PROBE = """
import resource, sys, torch
from parallel.memory.host import steady_host_allocations
mode, count, size, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if mode == "steady":
    assert steady_host_allocations()
if mode in ("cpu", "offload"):
    assert steady_host_allocations(keep_large=True)
if mode == "offload":  # what the offload engine sets after the worker's setting (parallel/strategies/offload/engine.py)
    from parallel.strategies.offload.engine import _return_freed_memory
    _return_freed_memory()
def step():
    tensors = [torch.ones(size) for _ in range(count)]
    del tensors
for _ in range(warm):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def faults(mode: str, count: int, elements: int, warm: int = 3) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(count), str(elements), str(warm)],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@LINUX
def test_a_workers_step_tensors_stay_in_the_process():
    # 40 tensors of 100 kB. glibc's own: the freed 4 MB at the heap's top goes back to the system each round and
    # faults in again.
    assert faults("glibc", 40, 25_000) > 20 * 100
    assert faults("steady", 40, 25_000) < 20


@LINUX
def test_a_cpu_workers_blocks_above_32_mib_stay_in_the_process_and_offload_returns_them():
    # A tensor of 40 MB (9,766 pages a round): above the mmap threshold a worker sets, it is a mapping of its own,
    # faulted in every round; a worker computing on the CPU takes it from the heap and keeps it; offload gives
    # freed memory back again. The heap may grow for a few rounds first, while what else the process allocates
    # leaves no hole of that size (here 2 to 5 rounds; with two such tensors a round, more than 8 in one run).
    assert faults("steady", 1, 10_000_000) > 20 * 8_000
    assert faults("cpu", 1, 10_000_000, warm=20) < 20
    assert faults("offload", 1, 10_000_000) > 20 * 8_000


# A fresh process under a CPU worker's setting frees a 200 MB tensor that a small one allocated after it keeps
# inside the heap; prints its resident memory (VmRSS, kB) then, and after what the offload engine sets.
KEPT = """
import torch
from parallel.memory.host import steady_host_allocations
from parallel.strategies.offload.engine import _return_freed_memory
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
assert steady_host_allocations(keep_large=True)
big = torch.ones(50_000_000)
pin = torch.ones(1_000)
del big
kept = rss()
_return_freed_memory()
print(kept, rss())
"""


@LINUX
def test_offload_gives_back_what_a_cpu_worker_freed_before_it():
    # Note [host allocations]: the whole model rank 0 builds under model.init=module is freed before the engine.
    out = subprocess.run([sys.executable, "-c", KEPT], capture_output=True, text=True, check=True)
    kept, after = (int(v) for v in out.stdout.split())
    assert kept - after > 150_000, (kept, after)
