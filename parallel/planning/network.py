"""Collective times on a hardware profile: NCCL's ring and tree algorithms over the links a group's ranks span.

# Note [collective model]
A collective over a group of n ranks, handed S bytes (its input, as Note
[step work] counts it), is priced as NCCL runs it, from each link's
bandwidth B (bytes/s per direction, per device) and the latency a of one
step over it (conf/hardware/*.yaml, Note [hardware profiles]):

    all-reduce      ring: 2 (n-1)/n x S / B + 2 (n-1) x a (a reduce-scatter,
                    then an all-gather: each rank sends 2 (n-1)/n of the
                    data, in 2 (n-1) steps); tree: 2 S / B + 2 ceil(log2 n)
                    x a (NCCL's double binary tree: up to the root and down
                    again, log2 n steps each way, every byte through each
                    rank twice). The faster of the two, as NCCL's tuner picks:
                    the tree for small messages over many ranks.
    all-gather      (n-1)/n x n S / B + (n-1) x a  (S is one rank's shard)
    reduce-scatter  (n-1)/n x S / B + (n-1) x a
    all-to-all      (n-1)/n x S / B + a  (every rank sends to all the others
                    at once)
    broadcast       S / B + (n-1) x a  (a ring, pipelined in chunks)
    send            S / B + a  (a pipeline's point to point)

Any other collective (a barrier, ops no strategy makes) is priced as an
all-reduce of what it is handed.

Where the group lies: rank r sits on node r // devices_per_node (torchrun's
numbering), so with the mesh's tp innermost (Note [mesh dimensions] in
parallel/dims.py) a tensor-parallel group of at most devices_per_node ranks
stays inside a node, and a data-parallel group strides across nodes. The
planner records each collective's group as its global ranks (Note [step
work]: comm_groups); DDP's buckets go over the data-parallel mesh (dp x ep x
cp). A group with k ranks on each of m > 1 nodes runs hierarchically: inside
a node over the node link (NVLink), across nodes each rank over its own
network port (the profile's per-device network bandwidth, B_net):

    all-reduce      ring: a reduce-scatter inside the node, an all-reduce of
                    each rank's S / k across the m nodes, an all-gather
                    inside the node: 2 (k-1)/k x S / B_node + 2 (k-1) x
                    a_node + 2 (m-1)/m x (S / k) / B_net + 2 (m-1) x a_net;
                    tree: 2 S / min(B_node, k B_net) + 2 ((k-1) a_node +
                    ceil(log2 m) a_net) (NCCL's tree is a chain inside a node
                    and a tree across nodes); the faster
    all-gather      each rank's part of the output across nodes, then the
                    whole inside the node: (m-1)/m x (n S / k) / B_net +
                    (m-1) a_net + (k-1)/k x n S / B_node + (k-1) a_node
    reduce-scatter  the mirror: (k-1)/k x S / B_node + (k-1) a_node + (m-1)/m
                    x (S / k) / B_net + (m-1) a_net
    all-to-all      what goes to the node's other ranks and what leaves it, at
                    once: max((k-1)/n x S / B_node, (n-k)/n x S / B_net) +
                    a_net
    broadcast       S / min(B_node, k B_net) + (k-1) a_node + (m-1) a_net
    send            across nodes when the group spans them: S / B_net + a_net

With k = 1 (one rank of the group per node) these are the one-level formulas
over the network. Left out: NCCL's fixed cost per call (its tuner's base
latency, a few microseconds), its protocols' lower bandwidth for mid-sized
messages (LL, LL128), contention between collectives that run at once and
with the compute's memory traffic, and the network's topology beyond one
port per device (rail-optimized, no oversubscription).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from parallel.config import HardwareConfig


@dataclass(frozen=True)
class Link:
    """A link's bandwidth (bytes/s per direction, per device) and the latency of one step over it (s)."""
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks lie: `per_node` of them on each of `nodes` nodes (Note [collective model])."""
    per_node: int
    nodes: int

    @property
    def size(self) -> int:
        return self.per_node * self.nodes


def placement(ranks: list[int] | tuple[int, ...], devices_per_node: int, size: int | None = None) -> Placement:
    """The placement of a group of global `ranks` on nodes of `devices_per_node` devices; without ranks, a
    group of `size` consecutive ones."""
    if not ranks:
        size = size or 1
        return Placement(min(size, devices_per_node), -(-size // devices_per_node))
    per = {}
    for r in ranks:
        per[r // devices_per_node] = per.get(r // devices_per_node, 0) + 1
    return Placement(max(per.values()), len(per))


def group_ranks(shape: tuple[int, ...], rank: int, dims: tuple[int, ...]) -> list[int]:
    """The global ranks of `rank`'s group over mesh dimensions `dims` of a mesh of `shape` (row-major, the last
    dimension innermost, as parallel.dims builds it)."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    index = [rank // strides[i] % shape[i] for i in range(len(shape))]
    out = []
    for values in itertools.product(*(range(shape[d]) for d in dims)):
        at = list(index)
        for d, v in zip(dims, values):
            at[d] = v
        out.append(sum(i * s for i, s in zip(at, strides)))
    return sorted(out)


def links(hw: HardwareConfig) -> tuple[Link, Link]:
    """The profile's node link and network as Links (a missing latency is 0)."""
    def of(link) -> Link:
        return Link(float(link.bandwidth or 0.0), float(link.latency or 0.0))

    return of(hw.node_link), of(hw.network)


def _ring(n: int, share: float, nbytes: float, link: Link, steps: int) -> float:
    return share * nbytes / link.bandwidth + steps * link.latency if n > 1 else 0.0


def one_level(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds of one call over `n` ranks all joined by `link` (Note [collective model], the first table)."""
    if n <= 1:
        return 0.0
    if kind == "allreduce":
        ring = _ring(n, 2 * (n - 1) / n, nbytes, link, 2 * (n - 1))
        tree = 2 * nbytes / link.bandwidth + 2 * math.ceil(math.log2(n)) * link.latency
        return min(ring, tree)
    if kind == "allgather":
        return _ring(n, n - 1, nbytes, link, n - 1)  # (n-1)/n of the n S output
    if kind == "reducescatter":
        return _ring(n, (n - 1) / n, nbytes, link, n - 1)
    if kind == "alltoall":
        return (n - 1) / n * nbytes / link.bandwidth + link.latency
    if kind == "broadcast":
        return nbytes / link.bandwidth + (n - 1) * link.latency
    if kind == "send":
        return nbytes / link.bandwidth + link.latency
    return one_level("allreduce", nbytes, n, link)


def hierarchical(kind: str, nbytes: float, where: Placement, node: Link, net: Link) -> float:
    """Seconds of one call over a group of `where.per_node` ranks on each of `where.nodes` nodes (Note
    [collective model], the second table)."""
    k, m = where.per_node, where.nodes
    n = k * m
    if m == 1:
        return one_level(kind, nbytes, k, node)
    if k == 1:
        return one_level(kind, nbytes, m, net)
    if kind == "allreduce":
        ring = (_ring(k, 2 * (k - 1) / k, nbytes, node, 2 * (k - 1))
                + _ring(m, 2 * (m - 1) / m, nbytes / k, net, 2 * (m - 1)))
        tree = (2 * nbytes / min(node.bandwidth, k * net.bandwidth)
                + 2 * ((k - 1) * node.latency + math.ceil(math.log2(m)) * net.latency))
        return min(ring, tree)
    if kind == "allgather":
        whole = n * nbytes
        return _ring(m, (m - 1) / m, whole / k, net, m - 1) + _ring(k, (k - 1) / k, whole, node, k - 1)
    if kind == "reducescatter":
        return _ring(k, (k - 1) / k, nbytes, node, k - 1) + _ring(m, (m - 1) / m, nbytes / k, net, m - 1)
    if kind == "alltoall":
        return max((k - 1) / n * nbytes / node.bandwidth, (n - k) / n * nbytes / net.bandwidth) + net.latency
    if kind == "broadcast":
        return nbytes / min(node.bandwidth, k * net.bandwidth) + (k - 1) * node.latency + (m - 1) * net.latency
    if kind == "send":
        return nbytes / net.bandwidth + net.latency
    return hierarchical("allreduce", nbytes, where, node, net)


def canonical(kind: str) -> str:
    """A work kind (Note [step work]) as the table names it: `alltoallbase` is an all-to-all, DDP's `bucket`
    an all-reduce, `isend` a send."""
    if kind.startswith("alltoall"):
        return "alltoall"
    if kind == "bucket":
        return "allreduce"
    if kind.endswith("send"):
        return "send"
    return kind


def call_seconds(hw: HardwareConfig, kind: str, nbytes: float, where: Placement) -> float:
    """Seconds of one collective call of `kind` handed `nbytes`, over a group placed as `where`, on profile
    `hw` (Note [collective model])."""
    node, net = links(hw)
    return hierarchical(canonical(kind), float(nbytes), where, node, net)
