"""The op calls of a planned step (Note [step work]) run on this machine on real tensors and timed: what
parallel.planning.cost prices a step with when the run computes here (Note [cost model]), and what
parallel.planning.calibration fits its replay scale with (Note [calibration])."""
from __future__ import annotations

import functools
import math
import statistics
import time

import torch

from parallel.hardware import last_level_cache
from parallel.planning.work import byte_class, size_class


def _elements(shape, stride, offset: int) -> int:
    """Elements of the storage a tensor of this shape, strides and offset needs (at least one)."""
    return max(offset + (1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0), 1)


_POOL = 1 << 16  # the elements of the random values each floating operand repeats (256 KB in float32)


@functools.lru_cache(maxsize=None)
def _pool(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(_POOL, dtype=dtype, device=device).uniform_(0.5, 1.5)


def _fill(base: torch.Tensor) -> None:
    """A new 1-D tensor's elements from [0.5, 1.5): the pool's random values over and over. Copied, not drawn:
    the operand sets of a plan's calls span up to twice the last-level cache each, and drawing them took
    most of a plan's pricing here (5.7 of 7.1 s of launch/calibrate.py's four plans; a copy is ~10x faster)."""
    pool = _pool(base.dtype, base.device)
    whole, rest = divmod(base.numel(), _POOL)
    if whole:
        base[:whole * _POOL].view(whole, _POOL).copy_(pool.expand(whole, _POOL))
    base[whole * _POOL:].copy_(pool[:rest])


def _real(spec, device: torch.device):
    """A real argument made from its description (parallel.planning.work.spec): tensors of the shape, strides,
    offset and dtype, floating ones in [0.5, 1.5) (no square root of a negative, nothing that shrinks to
    denormals in a few calls), integer and boolean ones zeros (a valid index)."""
    kind = spec[0]
    if kind == "tensor":
        _, shape, stride, offset, dtype = spec
        base = torch.empty(_elements(shape, stride, offset), dtype=dtype, device=device)
        _fill(base) if dtype.is_floating_point or dtype.is_complex else base.zero_()
        return base.as_strided(shape, stride, offset)
    if kind in ("list", "tuple"):
        items = [_real(v, device) for v in spec[1:]]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _real(v, device) for k, v in spec[1:]}
    if kind == "generator":
        return None
    # A device the plan names (its own, the CPU, when it plans a CUDA run there: autocast's casts, factory
    # ops) is the replay's: a copy to it would otherwise time a transfer to host memory the run never makes.
    return device if isinstance(spec[1], torch.device) else spec[1]


def _nbytes(spec) -> int:
    """Bytes of the tensors an argument description makes (`_real`)."""
    kind = spec[0] if spec else None
    if kind == "tensor":
        _, shape, stride, offset, dtype = spec
        return _elements(shape, stride, offset) * dtype.itemsize
    if kind in ("list", "tuple"):
        return sum(_nbytes(v) for v in spec[1:])
    if kind == "dict":
        return sum(_nbytes(v) for _, v in spec[1:])
    return 0


PROBE = 128  # the side of the probe product (Replay's `probe_s`)


def probe_seconds(rate: float) -> float:
    """The probe product's time at `rate` FLOP/s (a calibration's rate for its size class): what a calibration
    made before its probe was measured (Calibration.probe_s 0) holds a replay to."""
    return 2 * PROBE ** 3 / rate


def probe_time(device: torch.device, repeats: int = 5, probe: torch.Tensor | None = None,
               bursts: int = 1) -> float | None:
    """The probe product's time in this process now, on a CPU (None elsewhere): the fastest of `repeats` after a
    warm-up, as `Replay` times it beside each call (`probe`: the operand to use, else a new one); with `bursts`,
    the median of that many such, 10 ms apart (one burst lasts a quarter of a millisecond: one of five
    calibrations here timed it 52.8 us, the others 43.6-43.9 us).
    """
    if device.type != "cpu":
        return None
    probe = torch.ones(PROBE, PROBE, device=device) if probe is None else probe
    fastest = []
    for burst in range(bursts):
        if burst:
            time.sleep(0.01)
        probe @ probe
        fastest.append(min(_once(lambda: probe @ probe) for _ in range(repeats)))
    return statistics.median(fastest)


# Bytes of the heap's top written before a call shape is timed on a CPU where its warm-up faulted pages in
# (Replay._time): below the workers' mmap threshold (32 MiB, Note [host allocations]), so that they come from
# the heap and stay there when freed
HEAP_TOUCHED = 30 << 20


def _touch_heap() -> None:
    """The next HEAP_TOUCHED bytes of the heap's top in memory, as a long-lived worker's heap is.

    A call's output is carved from the heap, often from its top. Where the top was just given back to the
    system (an earlier call shape's operand sets freed past the trim threshold) or never used, a call there
    faults its output's pages in. Seen here: each call's new output of 1 MB placed 1 MB above the last one's,
    though that one was freed, 256 page faults a call, a sqrt 680-910 us where the same call took 140-180 us
    on memory in use. A worker's heap has been through the same step many times, and its steps fault about 4
    times a step (Note [host allocations]). Touched before every call shape, launch/plan.py's strategy=auto
    took 8-13% longer here; touched only where the warm-up faulted (Replay._time), no longer measurably; a
    touch sized by the call's outputs left one plan's price 1.24x apart between processes."""
    scratch = torch.empty(HEAP_TOUCHED, dtype=torch.uint8)
    scratch.fill_(1)
    del scratch


def _faults() -> int:
    """This process's minor page faults so far (0 where the platform does not say)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Replay:
    """Each distinct op call of a planned step run here on real tensors and timed (Note [cost model]), once
    per call shape for every candidate priced with it.

    Args:
        device: where the run computes (this machine's).
        threads: the torch threads each worker of the run will have (None: this process's).
        probe_s: on a CPU, the time of a 128 x 128 product when the machine was calibrated: beside each call
            a probe product is timed too, and the call's time taken at the speed the probe then had (here a
            256 x 256 product took 330-460 us from one second to the next on an idle machine, and one plan's
            calls came out twice as slow as the same calls in the next plan). None: as timed.
        clock: what times the calls (seconds); a test passes its own.

    On a CPU a call is timed on its operands as the step finds them (Note [cost model]): over `copies` sets
    of operands in turn that together span the bytes the step passes over once (weights, gradients,
    optimizer state, of every worker sharing the last-level cache), up to twice that cache. A step the cache
    holds finds them there, not in the caches closer to the core, where a call repeated on one set does; a
    step that passes it finds them evicted by the rest of the step.
    """

    BATCH_S = 2e-4  # the shortest batch of repeats timed for one sample of a short call
    COPIES = 64  # the most operand sets a call is timed over

    def __init__(self, device: torch.device, threads: int | None = None, probe_s: float | None = None,
                 clock=time.perf_counter):
        self.device, self.threads, self.clock = device, threads, clock
        self.probe_s = probe_s if device.type == "cpu" else None
        self.seconds: dict[tuple, float | None] = {}  # (call, copies) -> seconds (None: could not run here)
        self.cache = last_level_cache() if device.type == "cpu" else 0
        self._probe = torch.ones(PROBE, PROBE, device=device) if self.probe_s else None

    def _speed(self) -> float:
        """The probe's time now over its calibrated time (1: as calibrated; 2: twice as slow), within 1/4..4."""
        if self._probe is None:
            return 1.0
        return min(4.0, max(0.25, probe_time(self.device, 3, self._probe) / self.probe_s))

    def copies(self, key: tuple, span: int) -> int:
        """How many operand sets a call is timed over in a step of `span` bytes: as many as span, rounded up to
        a power of two (up to twice the last-level cache), holds, 1 to COPIES; 1 off the CPU.

        The rounding makes candidates of nearly the same bytes time a call shape on the same sets, once: timed
        again, one shape's time moves by more than such candidates differ (the gpt of benchmarks/auto.py: data
        zero 0 and 1, the same forward and backward over 26 and 20 MB, priced 107.9 and 97.7 ms of products,
        and ranked the wrong way round)."""
        if not self.cache:
            return 1
        size = max(1, _nbytes(key[1]) + _nbytes(key[2]))
        span = 1 << (span - 1).bit_length() if span > 0 else 0
        return max(1, min(self.COPIES, math.ceil(min(span, 2 * self.cache) / size)))

    def _time(self, key: tuple, copies: int = 1) -> float | None:
        """Seconds of one call: the median of three batches, each of at least `BATCH_S` of calls (one call
        where a call is longer), after a warm-up. A call shape stands for every time the step makes it
        (96 times a step for a small pipeline's products), so one sample's error, a moment when another
        process takes the core, would be multiplied by that. Over `copies` operand sets: warmed on the set
        made last; on a CPU then on every set in turn (in the cache after it, when they fit there), and where
        that faulted pages in, again after the heap's top is touched (`_touch_heap`); then each call on the
        next set from the first made (evicted by the rest, when they pass the cache)."""
        func, args, kwargs = key
        try:
            sets = [(_real(args, self.device), _real(kwargs, self.device)) for _ in range(copies)]
            cpu = self.device.type == "cpu"
            sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
            func(*sets[-1][0], **sets[-1][1])  # warm: the kernel's first call allocates and picks its path
            if cpu:
                before = _faults()
                for a, k in sets:  # warmed in turn: in the cache after it, when they fit there
                    func(*a, **k)
                if _faults() > before:  # its outputs on pages not in use: the heap's top touched, warmed again
                    _touch_heap()
                    for a, k in sets:
                        func(*a, **k)
            sync()
            t0 = self.clock()
            func(*sets[0][0], **sets[0][1])
            sync()
            once = self.clock() - t0
            reps = max(1, min(50, int(self.BATCH_S / max(once, 1e-7))))
            batches, turn = [once], 1
            for _ in range(2):
                t0 = self.clock()
                for _ in range(reps):
                    a, k = sets[turn % copies]
                    func(*a, **k)
                    turn += 1
                sync()
                batches.append((self.clock() - t0) / reps)
            return statistics.median(batches) / self._speed()
        except Exception:  # noqa: BLE001 - a call that needs real values (or another device): priced by class
            return None

    def price(self, calls: dict, cal, span: int = 0) -> dict[str, float]:
        """Seconds of a role's calls: those with FLOPs ("products") and the rest ("memory"); a call that
        cannot run here is priced by its class with `cal`'s rates (Note [step work]; None: left out). `span`:
        the bytes the step's operands spread over in the cache (0: each call's own, as repeated alone)."""
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        out = {"products": 0.0, "memory": 0.0}
        try:
            with torch.no_grad():
                for key, (n, flops, moved) in calls.items():
                    timed = (key, self.copies(key, span))
                    if timed not in self.seconds:
                        self.seconds[timed] = self._time(*timed)
                    t = self.seconds[timed]
                    if t is None and cal is None:
                        continue
                    if t is None:
                        t = (flops / cal.product_rate(size_class(flops)) if flops else
                             moved * cal.memory_time(byte_class(moved)) + cal.op_s)
                    out["products" if flops else "memory"] += n * t
        finally:
            torch.set_num_threads(before)
        return out
