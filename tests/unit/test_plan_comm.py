"""Each collective counted as the bytes that leave the rank under the ring algorithms (Note [comm bytes]), W the
size of the op's own group: the process-group ops and the functional ones, on the fake process group."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel.planning.comm import CommBytes

S = 1024  # bytes handed to each op: 256 fp32


@pytest.fixture()
def groups():
    """Rank 1 of 4 (the world group) and a group of 2 inside it."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield dist.group.WORLD, dist.new_group([0, 1])
    finally:
        dist.destroy_process_group()


def _sent(op) -> tuple[int, int]:
    with CommBytes() as comm:
        op()
    return comm.bytes, comm.all_to_all


def test_each_collective_counts_what_leaves_the_rank(groups):
    world, pair = groups
    x = torch.ones(S // 4)
    # torch 2.13 added all_gather_single and reduce_scatter_single; 2.11 and 2.12 spell them the older way.
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    f_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
    f_scatter = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)
    cases = {  # name: (op, bytes sent)
        "all_reduce": (lambda: dist.all_reduce(x), 2 * 3 * S // 4),
        "all_reduce over 2": (lambda: dist.all_reduce(x, group=pair), 2 * 1 * S // 2),
        "functional all_reduce": (lambda: funcol.all_reduce(x, "sum", world).wait(), 2 * 3 * S // 4),
        "all_gather_single": (lambda: gather(torch.empty(4 * x.numel()), x), 3 * S),
        "all_gather": (lambda: dist.all_gather([torch.empty_like(x) for _ in range(4)], x), 3 * S),
        "functional all_gather over 2": (lambda: f_gather(x, 0, pair).wait(), 1 * S),
        "reduce_scatter_single": (lambda: scatter(torch.empty(x.numel() // 4), x), 3 * S // 4),
        "functional reduce_scatter": (lambda: f_scatter(x, "sum", 0, world).wait(), 3 * S // 4),
        "broadcast": (lambda: dist.broadcast(x, src=0), S),
        "send": (lambda: dist.send(x, dst=0), S),
        "recv": (lambda: dist.recv(x, src=0), 0),
    }
    got = {name: _sent(op)[0] for name, (op, _) in cases.items()}
    assert got == {name: sent for name, (_, sent) in cases.items()}


def test_an_all_to_all_counts_what_leaves_the_rank_as_its_own_part(groups):
    x = torch.ones(S // 4)
    assert _sent(lambda: dist.all_to_all_single(torch.empty_like(x), x)) == (3 * S // 4, 3 * S // 4)
    # Uneven splits: rank 1 keeps its own 1/8 of the input.
    splits = [x.numel() // 2, x.numel() // 8, x.numel() // 4, x.numel() // 8]
    assert _sent(lambda: dist.all_to_all_single(torch.empty_like(x), x, splits, splits)) == (7 * S // 8, 7 * S // 8)
