"""Note [host allocations] (parallel/memory/host.py): with the thresholds a worker sets, a step's tensors are
reused from the heap step after step instead of being given back to the system and faulted in again."""
import subprocess
import sys

import pytest

# A fresh process allocating 40 tensors of 100 kB and freeing them, as a step's activations come and go, 20
# times; prints the minor page faults of those rounds, with the worker's setting or glibc's own.
PROBE = """
import resource, sys, torch
from parallel.memory.host import steady_host_allocations
if sys.argv[1] == "steady":
    assert steady_host_allocations()
def step():
    tensors = [torch.ones(25_000) for _ in range(40)]
    del tensors
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_workers_step_tensors_stay_in_the_process():
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    # glibc's own: the freed 4 MB at the heap's top goes back to the system each round and faults in again.
    assert faults("glibc") > 20 * 100
    assert faults("steady") < 20
