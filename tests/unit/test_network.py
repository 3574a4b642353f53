"""The collective model (Note [collective model] in parallel/planning/network.py) against times worked by hand."""
import pytest

from parallel.planning.network import Link, Placement, group_ranks, hierarchical, one_level, placement

GiB = 2 ** 30
NVLINK = Link(bandwidth=450e9, latency=0.6e-6)  # an H100 node's NVLink, per direction, and one ring step
NET = Link(bandwidth=50e9, latency=2.7e-6)  # one 400 Gb/s port per GPU


def test_a_large_all_reduce_inside_a_node_is_the_ring():
    # 8 GPUs, 1 GiB: each sends 2 x 7/8 of it in 14 steps; the tree would send it twice (4.776 ms)
    ring = 2 * 7 / 8 * GiB / 450e9 + 14 * 0.6e-6
    assert ring == pytest.approx(4.1841e-3, rel=1e-4)
    assert one_level("allreduce", GiB, 8, NVLINK) == pytest.approx(ring)
    tree = 2 * GiB / 450e9 + 2 * 3 * 0.6e-6
    assert tree > ring


def test_a_small_all_reduce_over_many_ranks_is_the_tree():
    # 4 KiB over 64 ranks: 126 ring steps of latency against 2 x log2(64) = 12 of the tree's
    ring = 2 * 63 / 64 * 4096 / 50e9 + 126 * 2.7e-6
    tree = 2 * 4096 / 50e9 + 12 * 2.7e-6
    assert tree < ring
    assert one_level("allreduce", 4096, 64, NET) == pytest.approx(tree)
    assert one_level("allreduce", 4096, 6, NET) == pytest.approx(2 * 4096 / 50e9 + 2 * 3 * 2.7e-6)  # ceil(log2 6)


def test_gather_scatter_all_to_all_broadcast_and_send_inside_a_node():
    shard = 64 << 20  # one rank's shard: the output is 8 of them
    assert one_level("allgather", shard, 8, NVLINK) == pytest.approx(7 / 8 * 8 * shard / 450e9 + 7 * 0.6e-6)
    assert one_level("reducescatter", GiB, 8, NVLINK) == pytest.approx(7 / 8 * GiB / 450e9 + 7 * 0.6e-6)
    assert one_level("alltoall", GiB, 8, NVLINK) == pytest.approx(7 / 8 * GiB / 450e9 + 0.6e-6)
    assert one_level("broadcast", GiB, 8, NVLINK) == pytest.approx(GiB / 450e9 + 7 * 0.6e-6)
    assert one_level("send", GiB, 2, NVLINK) == pytest.approx(GiB / 450e9 + 0.6e-6)
    assert one_level("allreduce", GiB, 1, NVLINK) == 0.0  # a group of one sends nothing


def test_an_all_reduce_over_two_nodes_is_hierarchical():
    # 16 GPUs, 8 a node: a reduce-scatter in the node, each GPU's eighth all-reduced over the 2 nodes on its own
    # port, an all-gather in the node (6.874 ms); the tree chains the node and sends it all over the node's 8
    # ports, NVLink and the network at once (5.383 ms): the faster is taken
    where = Placement(per_node=8, nodes=2)
    ring = 2 * 7 / 8 * GiB / 450e9 + 14 * 0.6e-6 + 2 * 1 / 2 * (GiB / 8) / 50e9 + 2 * 2.7e-6
    tree = 2 * GiB / min(450e9, 8 * 50e9) + 2 * (7 * 0.6e-6 + 1 * 2.7e-6)
    assert (ring, tree) == (pytest.approx(6.8738e-3, rel=1e-4), pytest.approx(5.3825e-3, rel=1e-4))
    assert hierarchical("allreduce", GiB, where, NVLINK, NET) == pytest.approx(tree)
    # 4 KiB over 4 nodes: latency-bound, the tree's 2 x (7 NVLink + log2 4 network) steps (19.2 us) against the
    # ring's 14 NVLink + 6 network ones (24.6 us)
    small = hierarchical("allreduce", 4096, Placement(8, 4), NVLINK, NET)
    assert small == pytest.approx(2 * 4096 / 400e9 + 2 * (7 * 0.6e-6 + 2 * 2.7e-6))
    # one GPU a node (tp fills each node): the one-level ring over the network
    assert hierarchical("allreduce", GiB, Placement(1, 4), NVLINK, NET) == pytest.approx(
        2 * 3 / 4 * GiB / 50e9 + 6 * 2.7e-6)
    # inside one node the network is not used
    assert hierarchical("allreduce", GiB, Placement(8, 1), NVLINK, NET) == one_level("allreduce", GiB, 8, NVLINK)


def test_gather_scatter_and_all_to_all_across_nodes():
    where, shard = Placement(per_node=4, nodes=2), 1 << 20
    whole = 8 * shard
    assert hierarchical("allgather", shard, where, NVLINK, NET) == pytest.approx(
        1 / 2 * (whole / 4) / 50e9 + 2.7e-6 + 3 / 4 * whole / 450e9 + 3 * 0.6e-6)
    assert hierarchical("reducescatter", whole, where, NVLINK, NET) == pytest.approx(
        3 / 4 * whole / 450e9 + 3 * 0.6e-6 + 1 / 2 * (whole / 4) / 50e9 + 2.7e-6)
    # 3/8 of it to the node's others over NVLink and 4/8 off the node at once: the network's share is slower
    assert hierarchical("alltoall", whole, where, NVLINK, NET) == pytest.approx(4 / 8 * whole / 50e9 + 2.7e-6)
    assert hierarchical("send", whole, where, NVLINK, NET) == pytest.approx(whole / 50e9 + 2.7e-6)


def test_where_a_group_lies_follows_the_ranks():
    assert placement([0, 1, 2, 3, 4, 5, 6, 7], 8) == Placement(8, 1)  # a tp group inside a node
    assert placement([3, 11], 8) == Placement(1, 2)  # a dp pair across nodes
    assert placement([0, 1, 8, 9], 8) == Placement(2, 2)
    assert placement([], 8, size=16) == Placement(8, 2)  # no ranks known: consecutive ones
    # the mesh (dp, ep, pp, cp, tp) = (2, 1, 1, 1, 8): rank 3's dp group, and its tp group
    shape = (2, 1, 1, 1, 8)
    assert group_ranks(shape, 3, (0,)) == [3, 11]
    assert group_ranks(shape, 3, (4,)) == list(range(8))
    # (2, 2, 1, 2, 2): rank 5 is dp 0, ep 1, cp 0, tp 1; its data-parallel group (dp x ep x cp) keeps tp 1
    assert group_ranks((2, 2, 1, 2, 2), 5, (0, 1, 3)) == [1, 3, 5, 7, 9, 11, 13, 15]
