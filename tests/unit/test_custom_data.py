"""data=custom in one process: the order of map-style samples and of a stream's positions (world-size
independent, epochs, held-out samples), resuming a stream from its state, what the first sample sets, the
evaluation sources, and the configuration errors for datasets a run cannot take."""
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from parallel.config import ConfigError
from parallel.data import build_data, build_eval_data, example_input, planned_data
from parallel.data.custom import MapOrder, check_custom, split_indices
from parallel.data.custom.split import ShardPlan, interleave_rows
from parallel.tensors import as_call, split_rows
from parallel.validate import to_config_with_data, validate
from tests import user_data
from tests.cli import ROOT

CPU = torch.device("cpu")


def config_with_data(*overrides, target="tests.user_data.regression", world=1):
    """The validated config of `python launch/train.py data=custom data._target_=target *overrides`, and what
    validation read from the data (its DataSpec)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=["data=custom", f"data._target_={target}", *overrides])
    cfg, data = to_config_with_data(dcfg)
    validate(cfg, world, data)
    return cfg, data


def config(*overrides, target="tests.user_data.regression", world=1):
    """The validated config of `python launch/train.py data=custom data._target_=target *overrides`."""
    return config_with_data(*overrides, target=target, world=world)[0]


def global_batches(cfg, steps, dp_size, first=1, eval_source=False, data=None):
    """Step -> the global batch, concatenated from `dp_size` ranks' sources (read from step `first`); `data`:
    the config's DataSpec."""
    def make(r):
        if eval_source:
            return build_eval_data(cfg.data, cfg.trainer.seed, cfg.trainer.batch_size, r, dp_size)
        return build_data(cfg.data, cfg.trainer.seed, cfg.trainer.batch_size, r, dp_size, spec=data)

    ranks = [make(r) for r in range(dp_size)]
    try:
        return {s: [torch.cat(t) for t in zip(*(src.batch(s, CPU) for src in ranks))] for s in steps}
    finally:
        for src in ranks:
            src.close()


def test_map_order_is_epochs_of_whole_global_batches():
    order = MapOrder(np.arange(100), seed=3, batch_size=32, shuffle=True)
    epochs = [np.concatenate([order.global_batch(s) for s in range(1 + 3 * e, 4 + 3 * e)]) for e in range(2)]
    for seen in epochs:  # 3 whole batches an epoch; the 4 samples of the tail are dropped
        assert len(seen) == 96 and len(set(seen.tolist())) == 96
    assert not np.array_equal(epochs[0], epochs[1])  # each epoch its own permutation
    plain = MapOrder(np.arange(100), seed=3, batch_size=32, shuffle=False)
    assert plain.global_batch(2).tolist() == list(range(32, 64)) and plain.global_batch(4).tolist() == list(range(32))


@pytest.mark.parametrize("workers", [0, 1])
def test_map_global_batch_is_the_same_on_any_world_size(workers):
    cfg, data = config_with_data(f"data.workers={workers}", "trainer.batch_size=16")
    one, four = global_batches(cfg, range(1, 8), 1, data=data), global_batches(cfg, range(1, 8), 4, data=data)
    ds = user_data.regression()
    order = MapOrder(np.arange(96), cfg.trainer.seed, 16, shuffle=True)
    for step in range(1, 8):
        torch.testing.assert_close(four[step], one[step], rtol=0, atol=0)
        torch.testing.assert_close(one[step][0], ds.x[order.global_batch(step)], rtol=0, atol=0)
    resumed = global_batches(cfg, [5, 6], 2, first=5, data=data)  # a source started at step 5 (a resume)
    torch.testing.assert_close(resumed[6], one[6], rtol=0, atol=0)


def test_held_out_samples_are_never_trained_on_and_evaluated_in_order():
    cfg, data = config_with_data("data.eval_fraction=0.25", "trainer.batch_size=8")
    train, held = split_indices(96, 0.25, cfg.trainer.seed)
    assert len(held) == 24 and sorted(np.concatenate([train, held]).tolist()) == list(range(96))
    ds = user_data.regression()
    seen = torch.cat([b[0] for b in global_batches(cfg, range(1, 25), 2, data=data).values()])
    assert not (seen[:, None, :] == ds.x[held][None]).all(-1).any()  # 24 steps: 2 epochs of the other 72
    evaluated = global_batches(cfg, [1, 2, 3], 2, eval_source=True)
    torch.testing.assert_close(torch.cat([evaluated[i][0] for i in (1, 2, 3)]), ds.x[held], rtol=0, atol=0)
    source = build_eval_data(cfg.data, cfg.trainer.seed, 8)
    assert source.num_batches == 3
    source.close()


def test_eval_dataset_in_its_own_order():
    cfg, data = config_with_data("data.eval._target_=tests.user_data.regression", "+data.eval.args.seed=5",
                 "trainer.batch_size=32", "data.workers=0")
    got = global_batches(cfg, [1, 3], 2, eval_source=True)
    want = user_data.regression(seed=5)
    torch.testing.assert_close(got[3][0], want.x[64:96], rtol=0, atol=0)
    assert build_data(cfg.data, 0, 32, spec=data).order.per_epoch == 3  # the training set keeps all of its samples


def test_eval_stream_starts_again_at_each_evaluation():
    cfg = config("data.workers=0", "data.eval._target_=tests.user_data.stream", "+data.eval.args.length=64",
                 target="tests.user_data.stream")
    source = build_eval_data(cfg.data, 0, 32, 1, 2)
    assert source.num_batches is None
    first = [source.batch(i, CPU) for i in (1, 2)]
    torch.testing.assert_close(source.batch(1, CPU), first[0], rtol=0, atol=0)
    torch.testing.assert_close(first[1][0], global_batches(cfg, [2], 1, eval_source=True)[2][0][16:], rtol=0, atol=0)


@pytest.mark.parametrize("stateful", [True, False])
def test_stream_positions_and_resume(stateful):
    cfg, data = config_with_data("data.workers=0", f"+data.args.stateful={stateful}", target="tests.user_data.stream")
    one = global_batches(cfg, range(1, 5), 1, data=data)
    two = global_batches(cfg, range(1, 5), 2, data=data)
    for step in range(1, 5):
        torch.testing.assert_close(two[step], one[step], rtol=0, atol=0)
    source = build_data(cfg.data, 0, 32, spec=data)
    for step in (1, 2, 3):
        source.batch(step, CPU)
    state = source.state_dict()
    assert (state is not None) == stateful
    again = build_data(cfg.data, 0, 32, 1, 2, spec=data)
    if stateful:
        again.load_state_dict(state)
    x, _ = again.batch(4, CPU)
    torch.testing.assert_close(x, one[4][0][16:], rtol=0, atol=0)
    # From the state the stream starts at step 4's first position; without one it reads from 0 and drops.
    assert again.dataset.started_at == (96 if stateful else 0)


def test_hugging_face_stream_resumes_from_its_state():
    cfg, data = config_with_data("data.workers=0", target="tests.user_data.hf_stream")
    one = global_batches(cfg, range(1, 4), 1, data=data)
    torch.testing.assert_close(global_batches(cfg, [1, 2, 3], 2, data=data), one, rtol=0, atol=0)
    source = build_data(cfg.data, 0, 32, spec=data)
    for step in (1, 2):
        source.batch(step, CPU)
    again = build_data(cfg.data, 0, 32, spec=data)
    again.load_state_dict(source.state_dict())
    torch.testing.assert_close(again.batch(3, CPU), tuple(one[3]), rtol=0, atol=0)
    state = again.state_dict()["states"][3]
    assert state["position"] == 96 and state["dataset"]  # the stream's own state, after step 3


def test_stream_read_by_a_loader_process_keeps_its_state():
    cfg, data = config_with_data("data.workers=1", "+data.args.stateful=true", target="tests.user_data.stream")
    source = build_data(cfg.data, 0, 32, spec=data)
    for step in (1, 2):
        source.batch(step, CPU)
    assert source.state_dict()["states"][2]["position"] == 64
    source.close()


def test_first_sample_sets_task_sizes_and_keys():
    hf = config(target="tests.user_data.hf_classification").data
    assert (hf.task, hf.classes, hf.features, hf.input_key, hf.target_key) == ("classification", 3, 8, "x", "labels")
    cfg, data = config_with_data("model=gpt", target="tests.user_data.Tokens")
    lm = cfg.data
    assert (lm.task, lm.seq_len, lm.vocab_size, lm.input_key, lm.target_key) == ("lm", 6, 16, "input_ids", "labels")
    assert example_input(lm, spec=data).dtype == torch.long and example_input(lm, 3, spec=data).shape == (3, 6)
    x, y = planned_data(lm, 0, 32, 0, 2, spec=data).batch(1, CPU)
    assert x.shape == (16, 6) and y.shape == (16, 6) and y.dtype == torch.long
    regression = config("data.input_key=0", "data.target_key=1").data
    assert (regression.task, regression.features, regression.targets) == ("regression", 8, 2)
    collated = config("data.collate._target_=tests.user_data.take_first_two").data
    assert (collated.input_key, collated.target_key) == ("x", "y")


def test_fields_by_name_are_collated_cut_and_planned_as_a_dict():
    """data.input_key as a list (Note [inputs by name] in parallel/tensors.py): a dict of the fields, in that
    order, collated, cut into rows alike, planned as zeros (a mask as ones); the task and sizes from the first;
    an encoder-decoder's target of its own length is an lm target; the loss the model's by default."""
    fields = ["input_ids", "attention_mask", "labels"]
    cfg, data = config_with_data("model=custom", "model._target_=tests.seq2seq.t5",
                                 f"data.input_key=[{','.join(fields)}]",
                 "data.target_key=labels", target="tests.seq2seq.pairs")
    d = cfg.data
    assert (d.task, d.seq_len, d.vocab_size, d.input_key, cfg.loss.name) == ("lm", 8, 48, fields, "output")
    assert list(data.named) == fields and data.input == data.named["input_ids"]
    x, y = build_data(d, 0, 32, spec=data).batch(1, CPU)
    assert list(x) == fields and x["labels"].shape == y.shape == (32, 6) and torch.equal(x["labels"], y)
    assert [part["attention_mask"].shape[0] for part in split_rows(x, 4)] == [8] * 4
    assert torch.equal(split_rows(x, 4)[1]["input_ids"], x["input_ids"][8:16])
    planned = example_input(d, 3, CPU, spec=data)
    assert planned["input_ids"].shape == (3, 8) and bool((planned["attention_mask"] == 1).all())
    assert as_call(planned) == ((), planned) and as_call(y) == ((y,), {})


def test_fields_by_name_of_a_stream_split_into_shards_interleave_as_a_dict():
    parts = [({"a": torch.arange(3), "b": torch.arange(3) * 10}, torch.arange(3)),
             ({"a": torch.arange(3, 5), "b": torch.arange(3, 5) * 10}, torch.arange(3, 5))]
    plan = ShardPlan(shards=2, workers=2)  # shard 0 read by worker 0, shard 1 by worker 1
    x, y = interleave_rows(plan, [0, 1, 2, 3, 4], parts)
    assert torch.equal(x["b"], x["a"] * 10) and torch.equal(x["a"], y) and sorted(y.tolist()) == [0, 1, 2, 3, 4]


# (overrides, target, key the one-line error names, text it holds)
BAD = [
    ([], "tests.user_data.not_a_dataset", "data._target_", "not a dataset"),
    ([], "tests.user_data.missing", "data._target_", "cannot be imported"),
    (["data.input_key=pixels"], "tests.user_data.hf_classification", "data.input_key", "['x', 'labels']"),
    (["data.target_key=2"], "tests.user_data.regression", "data.target_key", "tuples of 2 items"),
    ([], "tests.user_data.images", "data.input_key", "field '0': torch.float32 features of shape (3, 4, 4)"),
    ([], "tests.user_data.scalar_targets", "data.target_key", "field '1', of shape ()"),
    ([], "tests.user_data.labels", "data.classes", "set data.classes=N"),
    (["data.classes=2"], "tests.user_data.labels", "data.classes", "holds id 2"),
    (["+data.args.n=20"], "tests.user_data.regression", "data._target_", "fewer than one global batch"),
    (["data.eval._target_=tests.user_data.wide"], "tests.user_data.regression", "data.eval._target_", "differ"),
    (["data.eval_fraction=0.25"], "tests.user_data.stream", "data.eval_fraction", "iterable"),
    (["+data.args.kind=count"], "tests.user_data.bad_shards", "data._target_", "n_shards is 'four': it must be"),
    (["+data.args.kind=raises"], "tests.user_data.bad_shards", "data._target_", "shard(4, 0) failed: ValueError"),
    (["+data.args.kind=number"], "tests.user_data.bad_shards", "data._target_", "returned a int, not an iterable"),
    (["data.eval_fraction=0.1"], "tests.user_data.regression", "data.eval_fraction", "fewer than one global batch"),
    (["data.collate._target_=tests.user_data.regression"], "tests.user_data.regression", "data.collate._target_",
     "collating a sample failed"),
    (["data.input_key=[0,0]"], "tests.user_data.regression", "data.input_key", "must name each once"),
    (["data.input_key=[0]"], "tests.user_data.regression", "data.input_key", "need dict samples; these are tuples"),
    (["data.input_key=[x,pixels]"], "tests.user_data.hf_classification", "data.input_key", "['x', 'labels']"),
]


@pytest.mark.parametrize("overrides,target,key,text", BAD, ids=[b[1].split(".")[-1] + ":" + b[2] for b in BAD])
def test_bad_datasets_are_config_errors(overrides, target, key, text):
    with pytest.raises(ConfigError) as info:
        config(*overrides, target=target)
    message = str(info.value)
    assert message.startswith(key + "=") and text in message and "\n" not in message


def test_eval_every_needs_eval_data():
    cfg, data = config_with_data()
    with pytest.raises(ConfigError, match=r"^trainer.eval_every=5: data=custom has no evaluation data"):
        check_custom(cfg.data, data, 32, eval_every=5)
    held, data = config_with_data("data.eval_fraction=0.5")
    check_custom(held.data, data, 32, eval_every=5)
