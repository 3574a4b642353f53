"""strategy=auto's candidate list (Note [auto]): microbatch counts for pipelines, recomputed and selective variants."""
from parallel.planning.auto import Candidate, candidates, recomputed, selective


def test_pipelines_are_tried_with_several_microbatch_counts():
    names = [c.name for c in candidates(4)]
    assert {"pipeline pp4 m4", "pipeline pp4 m8", "pipeline pp4 m16"} <= set(names)
    assert {"hybrid dp2 x pp2 zero 3 m2", "hybrid dp2 x pp2 zero 3 m8", "hybrid dp2 x tp2 zero 0"} <= set(names)
    m8 = next(c for c in candidates(4) if c.name == "pipeline pp4 m8")
    assert "strategy.microbatches=8" in m8.overrides
    # The user's own count is kept: one candidate per pipeline shape.
    given = [c.name for c in candidates(4, microbatches=8)]
    assert "pipeline pp4" in given and not any(" m" in n.split("pp4")[-1] for n in given if "pp" in n)


def test_context_parallel_candidates():
    names = [c.name for c in candidates(4)]
    assert {"context cp4", "hybrid dp2 x cp2 zero 0", "hybrid dp2 x cp2 zero 3"} <= set(names)
    dp_cp = next(c for c in candidates(4) if c.name == "hybrid dp2 x cp2 zero 3")
    assert dp_cp.overrides == ["strategy=hybrid", "strategy.dp=2", "strategy.zero=3", "strategy.cp=2", "strategy.pp=1"]


def test_a_candidate_over_budget_is_retried_with_recomputed_activations():
    again = recomputed(Candidate("data zero 3", ["strategy=data", "strategy.zero=3"]))
    assert again.name == "data zero 3, recompute"
    assert again.overrides == ["strategy=data", "strategy.zero=3", "strategy.activations=checkpoint"]
    assert recomputed(again) is None  # once
    assert recomputed(Candidate("offload", ["strategy=offload", "strategy.activations=device"])) is None


def test_a_recomputed_candidate_that_fits_is_tried_with_selective_recomputation():
    """Note [auto]: after checkpoint made it fit, the products' outputs saved (fewer FLOPs again), once."""
    fits = recomputed(Candidate("data zero 3", ["strategy=data", "strategy.zero=3"]))
    lighter = selective(fits)
    assert lighter.name == "data zero 3, selective"
    assert lighter.overrides == ["strategy=data", "strategy.zero=3", "strategy.activations=selective"]
    assert selective(lighter) is None and selective(Candidate("single", ["strategy=single"])) is None
    assert selective(Candidate("offload", ["strategy=offload", "strategy.activations=checkpoint"])) is None


def test_one_worker_candidates_are_single_and_offload():
    assert [c.name for c in candidates(1)] == ["single", "offload, activations device",
                                               "offload, activations checkpoint", "offload, activations auto"]


def test_expert_parallelism_is_tried_for_models_with_experts():
    names = [c.name for c in candidates(4, experts=True)]
    assert {"expert ep4 zero 0", "expert ep4 zero 3", "hybrid dp2 x ep2 zero 3"} <= set(names)
    assert not any(" ep" in c.name for c in candidates(4))


def test_hybrid_sharding_is_tried_for_each_proper_divisor_of_the_world():
    """Note [auto]: zero 3 in R groups for 1 < R < W; none on 2 ranks, where R = 2 would shard nothing."""
    hsdp = [c for c in candidates(8) if "dp_replicate" in c.name]
    assert [c.name for c in hsdp] == ["data zero 3 dp_replicate 2", "data zero 3 dp_replicate 4"]
    assert hsdp[0].overrides == ["strategy=data", "strategy.zero=3", "strategy.dp_replicate=2"]
    assert not any("dp_replicate" in c.name for c in candidates(2))
