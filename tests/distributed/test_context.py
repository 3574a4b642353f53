"""Context parallelism (strategy=context, strategy.cp in hybrid) trains to the same numbers as strategy=single
(a Hugging Face Llama: as the user's own loop, alone and under a pipeline),
and its attention over the cp ranks is exact (Note [context parallelism] in parallel/strategies/context)."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests import cli
from tests.hf_models import args, assert_as_plain

# The arguments of tests/distributed/test_hybrid.py's gpt, so that the single reference run is shared.
GPT = ["model=gpt", "data.task=lm", "model.args.dim=32", "model.args.heads=4", "data.seq_len=16",
       "model.args.layers=2"]

# name -> (strategy args, processes); the reference is the single run of cli.FAST + GPT (shared with test_hybrid)
CASES = {
    "dp2_cp2_zero3": (["strategy=hybrid", "strategy.dp=2", "strategy.cp=2", "strategy.zero=3"], 4),
    "cp2_tp2": (["strategy=hybrid", "strategy.cp=2", "strategy.tp=2"], 4),
}


# Evaluation and gradient accumulation: the single reference shared by the cp 2 and pp 2 x cp 2 runs.
EVAL = ["trainer.steps=4", "trainer.eval_every=2", "trainer.grad_accum=2"]


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory):
    """gpt under strategy=context on 2 ranks, with a checkpoint at step 3 (shared by two tests); ZeRO 1, so
    the checkpoint holds each rank's share of the optimizer state (Note [ZeRO 1] in parallel/optim.py)."""
    run_dir = tmp_path_factory.mktemp("cp2")
    cli.run(cli.FAST + GPT + ["nproc=2", "strategy=context", "strategy.zero=1", "trainer.checkpoint_every=3",
                              f"run_dir={run_dir}"], cwd=run_dir)
    return run_dir


@pytest.mark.timeout(300)
def test_context_matches_single(reference, cp2_run):
    ref = reference(cli.FAST + GPT)
    cli.assert_same_training(cp2_run, ref)
    # ZeRO 1: each of the 2 ranks keeps about half of the optimizer state single keeps.
    (whole,) = cli.metrics(ref)[-1]["optim_state_bytes_per_rank"]
    assert all(0.4 < share / whole < 0.6 for share in cli.metrics(cp2_run)[-1]["optim_state_bytes_per_rank"])


@pytest.mark.timeout(300)
def test_checkpoint_at_cp2_resumes_on_single(reference, cp2_run, tmp_path):
    """Saved at step 3 with each sequence split over 2 ranks, resumed on one process: steps 4-6 and the final
    weights are those of the single run (the checkpoint holds the unpartitioned names)."""
    cli.run(cli.FAST + GPT + [f"trainer.resume={cp2_run}/checkpoints/step-000003", f"run_dir={tmp_path}"],
            cwd=tmp_path)
    cli.assert_same_training(tmp_path, reference(cli.FAST + GPT), first_step=4)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_with_cp_matches_single(reference, tmp_path, case):
    strategy, nproc = CASES[case]
    cli.run(cli.FAST + GPT + strategy + [f"nproc={nproc}", f"run_dir={tmp_path}"], cwd=tmp_path, timeout=300)
    cli.assert_same_training(tmp_path, reference(cli.FAST + GPT))


@pytest.mark.timeout(300)
def test_evaluation_and_accumulation_under_cp_match_single(reference, tmp_path):
    """Evaluation scores each rank's chunks and adds them up over the cp ranks; gradient accumulation and
    ZeRO-2 sharding over the cp ranks keep the single run's numbers."""
    cli.run(cli.FAST + GPT + EVAL + ["nproc=2", "strategy=context", "strategy.zero=2", f"run_dir={tmp_path}"],
            cwd=tmp_path)
    _assert_same_training_and_evaluation(tmp_path, reference(cli.FAST + GPT + EVAL))


@pytest.mark.timeout(300)
def test_pipeline_with_cp_matches_single(reference, tmp_path):
    """pp 2 x cp 2 (Note [context parallelism under the pipeline]): the stages are traced on each rank's chunks
    with their positions as an input and their blocks attend over the cp ranks; training and evaluation keep the
    single run's numbers (the reference accumulates gradients in 2 micro-steps; the pipeline's 4 microbatches
    sum the same global loss)."""
    cli.run(cli.FAST + GPT + EVAL[:2] + ["nproc=4", "strategy=hybrid", "strategy.pp=2", "strategy.cp=2",
                                         f"run_dir={tmp_path}"], cwd=tmp_path, timeout=300)
    _assert_same_training_and_evaluation(tmp_path, reference(cli.FAST + GPT + EVAL))


def _assert_same_training_and_evaluation(run_dir, ref) -> None:
    cli.assert_same_training(run_dir, ref)
    got, want = ([r["eval_loss"] for r in cli.metrics(d) if "eval_loss" in r] for d in (run_dir, ref))
    assert len(want) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.timeout(240)
def test_llama_cp2_is_the_users_own_loop(tmp_path):
    """A Hugging Face Llama (rotary positions, grouped-query attention) through transformers' attention interface,
    each sequence split over 2 ranks: the user's own loop on one process."""
    cli.run(args("llama") + ["nproc=2", "strategy=context", f"run_dir={tmp_path}"], cwd=tmp_path)
    assert_as_plain(tmp_path, "llama")


@pytest.mark.timeout(240)
def test_llama_pp2_cp2_is_the_users_own_loop(tmp_path):
    """The same Llama in a pipeline of 2 stages, each sequence split over 2 ranks: the stages are traced on the
    chunks with their positions (rotary embeddings) as an input, and the attention ops in their traced blocks run
    over the cp ranks (Note [traced attention over the cp ranks])."""
    cli.run(args("llama") + ["nproc=4", "strategy=hybrid", "strategy.pp=2", "strategy.cp=2", f"run_dir={tmp_path}"],
            cwd=tmp_path, timeout=200)
    assert_as_plain(tmp_path, "llama")


def _attention_worker(rank: int, cp: int, store_path: str) -> None:
    from parallel.strategies.context.attention import SequenceShard

    store = dist.FileStore(store_path, cp)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cp)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 3, 4 * cp, 8, dtype=torch.float64, generator=g, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(2, 3, 4 * cp, 8, dtype=torch.float64, generator=g)
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        shard = SequenceShard(cp, rank, dist.group.WORLD)
        local = [shard.shard(t.detach(), 2).requires_grad_() for t in (q, k, v)]
        out = shard.attend(*local)
        out.backward(shard.shard(grad, 2))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out, shard.shard(want.detach(), 2), rtol=1e-12, atol=1e-12)
        for mine, whole in zip(local, (q, k, v)):
            torch.testing.assert_close(mine.grad, shard.shard(whole.grad, 2), rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_attention_over_three_ranks_is_exact(tmp_path):
    """Outputs and the gradients of q, k and v of each rank's chunks equal those of causal attention over the
    whole sequence (float64), with an odd cp (chunks 0+5, 1+4, 2+3)."""
    mp.start_processes(_attention_worker, args=(3, str(tmp_path / "store")), nprocs=3, join=True,
                       start_method="fork")


def _torch_ring_worker(rank: int, cp: int, store_path: str) -> None:
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )

    from parallel.strategies.context.cuda import TorchSequenceShard, enable_torch_context_parallel

    store = dist.FileStore(store_path, cp)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cp)
    try:
        enable_torch_context_parallel()  # load balancing on, keys and values all-gathered
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 3, 4 * cp, 8, dtype=torch.float64, generator=g, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(2, 3, 4 * cp, 8, dtype=torch.float64, generator=g)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want.backward(grad)
        shard = TorchSequenceShard(cp, rank, dist.group.WORLD)
        local = [shard.shard(t.detach(), 2) for t in (q, k, v)]
        # The CPU's flash kernel stands in for the CUDA one torch's ring runs on GPUs.
        cpu = torch.ops.aten

        def forward(q, k, v, is_causal, **_):
            return cpu._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, bool(is_causal))

        def backward(query, key, value, out, logsumexp, is_causal, grad_out):
            return cpu._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out,
                                                                            logsumexp, 0.0, bool(is_causal))

        out, lse = _templated_ring_attention(dist.group.WORLD, 2, forward, *local, is_causal=True)
        grads = _templated_ring_attention_backward(dist.group.WORLD, 2, backward, shard.shard(grad, 2), "grad_out",
                                                   *local, out, lse, is_causal=True)
        # torch merges the blocks in float32 (_cp_options.convert_to_f32).
        torch.testing.assert_close(out, shard.shard(want.detach(), 2), rtol=1e-6, atol=1e-6)
        for mine, whole in zip(grads, (q, k, v)):
            torch.testing.assert_close(mine, shard.shard(whole.grad, 2), rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_torchs_ring_attention_on_our_layout_is_exact(tmp_path):
    """The CUDA path's attention (Note [context parallelism on CUDA]): torch's load-balanced ring attention,
    forward and backward, on the chunks TorchSequenceShard hands each rank, equals causal attention over the
    whole sequence (the CPU's kernel standing in for CUDA's, over gloo)."""
    mp.start_processes(_torch_ring_worker, args=(3, str(tmp_path / "store")), nprocs=3, join=True,
                       start_method="fork")
