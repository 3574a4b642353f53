"""strategy=auto over a cluster (Note [auto over a cluster] in parallel/planning/cluster.py): the layouts that divide
the world and what rules them out, the screen's bound, and a search of a tiny gpt on 64 ranks of H100s."""
import dataclasses
import math
import time

import pytest

from parallel.config import Config
from parallel.models.build import build_meta_model
from parallel.planning import cluster
from parallel.planning.auto import choose
from parallel.planning.layouts import Layout, ModelShape, enumerate_layouts
from parallel.planning.screen import estimate, lower_bound
from parallel.strategies.pipeline import schedules
from tests.unit.test_kernels import profile

# A Llama 8B's shape, bf16 weights: 32 blocks of 218M parameters, 8.03B in all, 32 query and 8 kv heads.
L8B = ModelShape(params=8_030_261_248, block_params=218_112_000, blocks=32, param_bytes=2, nested=True,
                 hidden=4096, vocab=128256, heads=(32, 8))
GPT = {"vocab_size": 256, "seq_len": 32, "dim": 64, "heads": 4, "layers": 4}


def _cfg(batch: int = 128, seq: int = 8192, **changes) -> Config:
    cfg = Config()
    cfg.model.name, cfg.model.args = "gpt", dict(GPT)
    cfg.data.task, cfg.data.seq_len, cfg.data.vocab_size, cfg.trainer.batch_size = "lm", seq, 256, batch
    cfg.trainer.device, cfg.trainer.precision, cfg.hardware = "cuda", "bf16", profile("h100")
    cfg.strategy.name = "auto"
    for key, value in changes.items():
        section, _, name = key.partition("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_layouts_divide_the_world_with_tp_inside_a_node_and_the_models_rules_kept():
    found, refused = enumerate_layouts(64, L8B, _cfg(), per_node=8)
    assert found and all(lay.world == 64 for lay in found)
    assert {lay.tp for lay in found} == {1, 2, 4, 8}  # 16, 32, 64 would leave the node
    assert all(128 % lay.dp == 0 and 128 // lay.dp % lay.microbatches == 0 for lay in found)
    pipes = [lay for lay in found if lay.pp > 1]
    # the Llama's blocks are nested: tp beside pp splits its traced blocks (Note [tensor parallelism over traced
    # blocks])
    assert pipes and {lay.tp for lay in pipes} == {1, 2, 4, 8}
    assert {lay.schedule for lay in pipes} == set(schedules.SCHEDULES)
    assert all(lay.pp * lay.stages <= 32 and schedules.check(lay.schedule, lay.pp, lay.stages, lay.microbatches)
               is None for lay in pipes)
    assert all(lay.replicate == 1 or (lay.zero == 3 and lay.dp % lay.replicate == 0) for lay in found)
    assert {lay.activations for lay in found} == {"device", "selective", "checkpoint"}
    # The refusals are counted by reason: tp 16, 32 and 64 with every pp x cp that divides what is left.
    tp_out = sum(len([1 for pp in range(1, 65) if (64 // tp) % pp == 0 for cp in range(1, 65)
                      if (64 // tp // pp) % cp == 0]) for tp in (16, 32, 64))
    assert refused["tp not a divisor of the 8 devices of a node"] == tp_out
    # Every (dp, tp, pp, cp) that the rules let through, each with its shardings and policies.
    degrees = {lay.degrees for lay in found}
    assert (8, 8, 1, 1) in degrees and (64, 1, 1, 1) in degrees and (1, 8, 1, 8) in degrees


def test_heads_and_batch_and_sequence_rule_out_degrees():
    shape = ModelShape(params=10**6, block_params=10**5, blocks=6, param_bytes=4, nested=False, hidden=64,
                       vocab=256, heads=(6,))
    found, refused = enumerate_layouts(16, shape, _cfg(batch=4, seq=24), per_node=8)
    assert all(6 % lay.tp == 0 for lay in found)  # tp 4 and 8 do not divide six heads
    assert all(lay.dp <= 4 and 24 % (2 * lay.cp) == 0 for lay in found)
    assert all(lay.pp * lay.stages <= 6 for lay in found)
    assert any(k.startswith("tp does not divide the heads") for k in refused)
    assert any(k.startswith("dp does not divide the batch") for k in refused)
    assert any(k.startswith("cp: data.seq_len 24") for k in refused)


def test_the_bound_counts_the_states_as_the_layout_shards_them():
    cfg = _cfg()
    whole = lower_bound(Layout(64, 1, 1, 1, zero=0), L8B, cfg)
    assert whole >= L8B.params * 2 * 4  # weights, gradients and two moments of bf16
    sharded = lower_bound(Layout(64, 1, 1, 1, zero=3, activations="checkpoint"), L8B, cfg)
    assert sharded < whole / 5  # the 8.5 GB left: 32 saved block inputs and the logits of 16384 tokens
    # zero 3 in 8 replicas holds 8 x the states of zero 3 over all 64
    r8 = lower_bound(Layout(64, 1, 1, 1, zero=3, replicate=8), L8B, cfg)
    assert r8 > lower_bound(Layout(64, 1, 1, 1, zero=3), L8B, cfg)
    # tp and pp spread the states further (short sequences: the states alone)
    short = _cfg(seq=8)
    whole = lower_bound(Layout(64, 1, 1, 1, zero=0), L8B, short)
    assert lower_bound(Layout(8, 8, 1, 1, zero=0), L8B, short) == pytest.approx(whole / 8, rel=0.01)
    assert lower_bound(Layout(8, 1, 8, 1, zero=0, schedule="1F1B", microbatches=8), L8B, short) == \
        pytest.approx(whole / 8, rel=0.01)
    est = estimate(Layout(8, 8, 1, 1, zero=3, activations="checkpoint"), L8B, cfg, cfg.hardware, None)
    assert est.bound <= est.peak and est.step > 0


def test_a_layout_over_the_budget_by_its_bound_is_dropped_unplanned(tmp_path):
    cfg = _cfg(batch=64, seq=32)
    t0 = time.perf_counter()
    found, summary = cluster.search(cfg, 64, tmp_path, budget=1000, hw=cfg.hardware, progress=lambda s: None)
    assert found == [] and summary["planned"] == 0  # 1000 bytes: under every layout's bound
    assert sum(summary["screened_out"].values()) == summary["layouts"] > 100
    assert time.perf_counter() - t0 < 10  # nothing planned


@pytest.mark.timeout(120)
def test_a_search_on_64_ranks_plans_the_most_promising_and_ranks_them(tmp_path):
    """The tiny gpt on 64 H100s: the estimate's best planned (two plans), the fastest picked; each planned
    layout's bound below its planned peak."""
    cfg = _cfg(batch=64, seq=32, plan__auto_plans=2, memory__budget="80GB")
    searched, lines = {}, []
    chosen, found = choose(cfg, 64, tmp_path, progress=lines.append, searched=searched)
    assert searched["planned"] == len(found) == 2 and searched["fit"] == 2
    assert sum(searched["skipped"].values()) > 0 and "past plan.auto_plans=2" in searched["skipped"]
    steps = [c.times["step"] for c in found]
    assert steps == sorted(steps) and found[0].name == searched["top"][0]["name"]
    assert math.prod([chosen.strategy.dp, chosen.strategy.tp, chosen.strategy.pp, chosen.strategy.cp]) == 64
    top = searched["top"][0]
    assert top["tokens_per_s_per_device"] > 0 and 0 < top["mfu"] < 1 and top["reserved"] == found[0].peak
    assert any("layouts; ruled out before" in line for line in lines)
    shape = ModelShape.of(build_meta_model(cfg.model))
    by_name = {lay.name: lay for lay in enumerate_layouts(64, shape, cfg, 8)[0]}
    for c in found:
        assert lower_bound(by_name[c.name], shape, cfg) <= c.peak


def test_tensor_parallel_layouts_cut_the_sequence_where_the_models_plan_takes_it():
    """tp > 1 without pp or cp: sequence and loss parallelism, as torchtitan's tensor parallelism runs, where the
    model's plan takes them (probed once); the residual stream and the logits then count 1/tp in the screen."""
    found, _ = enumerate_layouts(64, dataclasses.replace(L8B, cuts_sequence=True), _cfg(), per_node=8)
    assert all(lay.sequence == (lay.tp > 1 and lay.pp == lay.cp == 1) for lay in found)
    assert not any(lay.sequence for lay in enumerate_layouts(64, L8B, _cfg(), per_node=8)[0])
    cfg = _cfg()
    lay = next(x for x in found if x.sequence and x.degrees == (8, 8, 1, 1) and x.zero == 3
               and x.activations == "checkpoint")
    assert lay.name.endswith(" sp, checkpoint")
    assert lay.overrides[-2:] == ["strategy.sequence_parallel=true", "strategy.loss_parallel=true"]
    whole = dataclasses.replace(lay, sequence=False)
    assert lower_bound(lay, L8B, cfg) < lower_bound(whole, L8B, cfg)
    assert estimate(lay, L8B, cfg, cfg.hardware, None).peak < estimate(whole, L8B, cfg, cfg.hardware, None).peak
    # the probe: the built-in gpt's plan takes both; a loss other than the built-in cross-entropy does not
    model = build_meta_model(cfg.model)
    assert cluster._cuts_sequence(model, _cfg(seq=32), None)
    assert not cluster._cuts_sequence(model, _cfg(seq=32, loss__name="mse"), None)


def test_a_pipeline_whose_split_cannot_fit_rules_out_its_layouts_with_no_less_memory():
    """A layout refused by the pipeline's split (no stages within memory.budget) is learnt as over the budget:
    the same pipeline with more replicas, a lower zero or more activations kept is not planned again; one with
    less memory is."""
    state = cluster._State(budget=10**9)
    lay = Layout(32, 1, 8, 1, zero=3, replicate=2, activations="checkpoint", schedule="Interleaved1F1B", stages=2,
                 microbatches=16)
    cand = lay.candidate()
    cand.dropped = "does not apply: memory.budget=96GB: no split into 16 stages fits 96000000000 bytes per stage"
    state.learn(lay, None, cand, True, 1.0)
    for other in (dataclasses.replace(lay, replicate=4), dataclasses.replace(lay, zero=2),
                  dataclasses.replace(lay, activations="device")):
        assert state.known(other) == "no less memory than a plan over the budget"
    assert state.known(dataclasses.replace(lay, replicate=1)) is None  # fewer replicas: less memory
