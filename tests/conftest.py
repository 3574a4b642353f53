import os

# Tiny models: one thread per process keeps multi-process tests from oversubscribing 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
