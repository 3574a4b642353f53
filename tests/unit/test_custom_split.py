"""Streams read in disjoint parts (parallel/data/custom/split.py) in one process: positions -> (shard,
element), which rank and loader worker reads which shard, the parts put back in order, per-shard fast-forward
and states, and a Hugging Face stream's shards read whole in loader workers."""
import logging

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from parallel.data import build_data, build_eval_data
from parallel.data.custom.split import (
    ShardPlan,
    interleave,
    interleave_rows,
    largest_divisor,
    locate,
    merge_states,
    samples_of,
    shard_count,
)
from tests import user_data
from tests.unit.test_custom_data import CPU, config, config_with_data


def test_positions_ranks_and_workers():
    assert [locate(p, 4) for p in (0, 3, 4, 9)] == [(0, 0), (3, 0), (0, 1), (1, 2)]
    two = [ShardPlan(4, 2, r, workers=2) for r in (0, 1)]
    assert [p.mine for p in two] == [[0, 2], [1, 3]] and all(p.disjoint for p in two)
    assert [p.worker_shards(w) for p in two for w in (0, 1)] == [[0], [2], [1], [3]]
    assert two[1].kept(8, 16) == [9, 11, 13, 15] and two[0].kept(8, 16) == [8, 10, 12, 14]
    # Each kept position's shard is the rank's own, and its i-th sample comes from worker i mod W.
    for plan in two:
        kept = plan.kept(0, 64)
        assert all(p % 4 in plan.mine for p in kept)
        assert [plan.reader_of(p % 4) for p in kept] == [i % 2 for i in range(len(kept))]
    three = ShardPlan(4, 3, 1, workers=3)  # 3 does not divide 4: every rank reads every shard
    assert three.mine == [0, 1, 2, 3] and not three.disjoint and three.readers == 2
    assert ShardPlan(6, 4, 1).mine == [1, 3, 5]  # gcd 2: shared by ranks 1 and 3
    assert [largest_divisor(n, w) for n, w in ((4, 3), (6, 4), (5, 2), (4, 0), (2, 8))] == [2, 3, 1, 1, 2]
    # Elements of shard s before position P: the positions p < P with p mod S == s.
    for position in (0, 1, 5, 8, 13):
        assert [ShardPlan(4).consumed(position, s) for s in range(4)] == \
            [sum(1 for p in range(position) if p % 4 == s) for s in range(4)]


def test_parts_interleave_back_into_order():
    plan = ShardPlan(8, 2, 1, workers=4)
    kept = plan.kept(32, 64)
    parts = [[p for p in kept if plan.reader_of(p % 8) == w] for w in range(plan.readers)]
    assert plan.readers == 4 and all(len(part) == 4 for part in parts)
    assert interleave(plan, kept, parts) == kept
    rows = [(torch.tensor(part), torch.tensor(part) * 10) for part in parts]  # parts collated row by row
    x, y = interleave_rows(plan, kept, rows)
    assert x.tolist() == kept and y.tolist() == [10 * p for p in kept]


def test_shard_states_merge_across_ranks():
    a = {3: {"position": 96, "shards": {0: "a0", 2: "a2"}}, 4: {"position": 128, "shards": {0: "b0", 2: "b2"}}}
    b = {3: {"position": 96, "shards": {1: "a1", 3: "a3"}}}
    assert merge_states([a, b]) == {3: {"position": 96, "shards": {0: "a0", 1: "a1", 2: "a2", 3: "a3"}}}


def rank_batches(run, steps, ranks, first=1, state=None):
    """Step -> the global batch's inputs in position order, put together from `ranks` ranks' sources (rank r
    holds positions p mod R == r), each started at step `first` (from `state` when given); `run`: the config
    and its DataSpec (`config_with_data`)."""
    cfg, data = run
    sources = [build_data(cfg.data, 0, 24, r, ranks, spec=data) for r in range(ranks)]
    try:
        if state is not None:
            for s in sources:
                s.load_state_dict(state)
        out = {}
        for step in steps:
            x = torch.empty(24, 8)
            for r, s in enumerate(sources):
                x[r::ranks] = s.batch(step, CPU)[0]
            out[step] = x
        return out, sources
    finally:
        for s in sources:
            s.close()


def expected(steps, shards=4, length=20):
    """Position p: element p // S of shard p mod S, each shard a cycle of its own (its epochs)."""
    out = {}
    for step in steps:
        rows = []
        for p in range((step - 1) * 24, step * 24):
            s, e = locate(p, shards)
            epoch, i = divmod(e, length + s)
            rows.append(user_data.sharded_sample(s, epoch, i)["x"])
        out[step] = torch.stack(rows)
    return out


@pytest.mark.parametrize("ranks,workers,collate", [(1, 0, None), (2, 2, None), (3, 0, None),
                                                   (1, 4, "tests.user_data.stack_fields")])
def test_split_stream_global_order_on_any_world_size(ranks, workers, collate):
    """Read in this process or in loader workers whose parts come collated (default collation) or as samples
    collated here (a user's collate function)."""
    run = config_with_data(f"data.workers={workers}", f"data.collate._target_={collate or 'null'}",
                           target="tests.user_data.sharded")
    got, _ = rank_batches(run, range(1, 7), ranks)  # 144 positions: every shard past its first epoch
    torch.testing.assert_close(got, expected(range(1, 7)), rtol=0, atol=0)
    resumed, sources = rank_batches(run, [5, 6], ranks, first=5)  # no state: each shard fast-forwarded
    torch.testing.assert_close(resumed, expected([5, 6]), rtol=0, atol=0)


def test_shard_states_resume_on_another_world_size(tmp_path):
    log = tmp_path / "reads.log"
    run = config_with_data("data.workers=0", "+data.args.stateful=true", f"+data.args.log={log}",
                           target="tests.user_data.sharded")
    cfg, data = run
    sources = [build_data(cfg.data, 0, 24, r, 2, spec=data) for r in range(2)]
    for step in (1, 2, 3):
        for s in sources:
            s.batch(step, CPU)
    states = [s.state_dict()["states"] for s in sources]  # each rank: its own shards
    assert sorted(states[0][3]["shards"]) == [0, 2] and sorted(states[1][3]["shards"]) == [1, 3]
    merged = {"states": merge_states(states)}
    shard = merged["states"][3]["shards"]
    assert [(shard[s]["element"], shard[s]["epoch"]) for s in range(4)] == [(18, 0)] * 4  # 72 positions
    log.write_text("")
    got, _ = rank_batches(run, [4, 5, 6], 1, first=4, state=merged)
    torch.testing.assert_close(got, expected([4, 5, 6]), rtol=0, atol=0)
    # Each shard started at its state (element 18 of epoch 0), not read from 0; then epoch 1 from 0.
    starts = sorted(tuple(int(v) for v in line.split()[2:]) for line in log.read_text().splitlines())
    assert starts == [(s, e, i) for s in range(4) for e, i in ((0, 18), (1, 0))]


class _OneShardEach(IterableDataset):
    """Loader worker w reads a one-shard Hugging Face stream whole (shard w + 1 of 4)."""

    def __init__(self, ds):
        self.ds = ds

    def __iter__(self):
        w = get_worker_info().id
        yield w, [int(r["shard"]) for r in samples_of(self.ds.shard(4, w + 1))]


def test_hugging_face_shard_is_read_whole_in_any_loader_worker():
    """datasets splits a stream among loader workers by itself (worker 1 of 2 would get nothing of a one-shard
    stream): samples_of must read it whole (this fails when datasets changes what `iter` does)."""
    ds = user_data.hf_sharded_stream(n=5).with_format("torch")
    assert shard_count(ds) == 4 and shard_count(ds.shard(4, 0)) == 1 and shard_count(user_data.stream()) == 1
    got = dict(DataLoader(_OneShardEach(ds), batch_size=None, num_workers=2))
    assert got == {0: [1] * 5, 1: [2] * 5}


def test_hugging_face_split_stream_resumes_from_shard_states():
    run = config_with_data("data.workers=2", target="tests.user_data.hf_sharded_stream")
    whole, _ = rank_batches(run, range(1, 7), 1)
    rows = {s: list(user_data._shard_rows([s], 30)) for s in range(4)}  # 30 rows a shard, again each epoch
    want = [torch.tensor(rows[p % 4][(p // 4) % 30]["x"]) for p in range(144)]
    torch.testing.assert_close(torch.cat([whole[s] for s in range(1, 7)]), torch.stack(want), rtol=0, atol=0)
    two, sources = rank_batches(run, range(1, 4), 2)
    torch.testing.assert_close(two, {s: whole[s] for s in (1, 2, 3)}, rtol=0, atol=0)
    state = {"states": merge_states([s.states for s in sources])}
    assert all(state["states"][3]["shards"][s]["dataset"] for s in range(4))  # the shards' own states
    resumed, _ = rank_batches(run, [4, 5, 6], 1, first=4, state=state)
    torch.testing.assert_close(resumed, {s: whole[s] for s in (4, 5, 6)}, rtol=0, atol=0)


def test_shards_a_rank_cannot_own_alone_are_said(caplog):
    cfg, data = config_with_data("data.workers=3", target="tests.user_data.sharded")
    with caplog.at_level(logging.INFO, logger="parallel"):
        build_data(cfg.data, 0, 24, 1, 3, spec=data).close()
    assert "the stream's 4 shards cannot be split among 3 data-parallel ranks" in caplog.text
    assert "data.workers=3, but a rank's 4 shards are read by 2 loader processes" in caplog.text


def test_split_eval_stream_starts_again_at_each_evaluation():
    cfg = config("data.workers=2", "data.eval._target_=tests.user_data.sharded", "+data.eval.args.length=5",
                 target="tests.user_data.sharded")
    sources = [build_eval_data(cfg.data, 0, 24, r, 2) for r in range(2)]
    try:
        for _ in range(2):  # the second evaluation reads batches 1, 2 again
            for i in (1, 2):
                x = torch.empty(24, 8)
                for r, s in enumerate(sources):
                    x[r::2] = s.batch(i, CPU)[0]
                torch.testing.assert_close(x, expected([i], length=5)[i], rtol=0, atol=0)
    finally:
        for s in sources:
            s.close()
