"""strategy=offload streams weights, optimizer state and activations, and trains to the single-device numbers."""
import os

import pytest

from tests import cli

MLP = ["model.args.depth=4"]
GPT = ["model=gpt", "data.task=lm", "model.args.dim=32", "model.args.heads=4", "data.seq_len=16"]
NO_CLIP = ["trainer.clip_grad_norm=0"]

# name -> (model args, offload args); the reference is `single` with the same model args
CASES = {
    "weights_and_optimizer_on_disk": (MLP, []),
    "step_during_backward_without_clipping": (MLP + NO_CLIP, []),
    "activations_on_disk": (MLP, ["strategy.activations=disk"]),
    "activations_on_disk_no_prefetch": (MLP + NO_CLIP, ["strategy.activations=disk", "strategy.prefetch=0"]),
    "checkpointing": (MLP, ["strategy.activations=checkpoint"]),
    "weights_on_device_optimizer_on_disk": (MLP, ["strategy.params=device"]),
    "gpt_activations_on_disk": (GPT, ["strategy.activations=disk", "strategy.prefetch=2"]),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(CASES))
def test_offload_matches_single(reference, tmp_path, case):
    model, offload = CASES[case]
    cli.run(cli.FAST + model + offload + ["strategy=offload", f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, reference(cli.FAST + model))
    last = cli.metrics(tmp_path)[-1]
    moved = last["offload_params_bytes"] + last["offload_optimizer_bytes"] + last["offload_activations_bytes"]
    assert moved > 0 and last["offload_wait_s"] >= 0
    if "strategy.activations=disk" in offload:
        assert last["offload_activations_bytes"] > 0
    assert not (tmp_path / "offload").exists()  # the disk tier is removed at the end


@pytest.fixture
def extractor(shared_dir):
    """A pretrained extractor's checkpoint and its weights: one file for the session, so that the tests
    naming it in their arguments share one reference run."""
    import torch

    gen = torch.Generator().manual_seed(7)
    widths = [32, 64, 64, 64]
    state = {}
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        state[f"frozen.{i}.fc.weight"] = torch.randn(b, a, generator=gen) * 0.1
        state[f"frozen.{i}.fc.bias"] = torch.randn(b, generator=gen) * 0.1
    ckpt = shared_dir / "extractor.pt"
    if not ckpt.exists():  # written whole under another name, then renamed: a reader never sees half of it
        part = shared_dir / f"extractor.pt.{os.getpid()}"
        torch.save(state, part)
        os.replace(part, ckpt)
    return ckpt, state


@pytest.mark.timeout(200)
@pytest.mark.parametrize("lookahead", [True, False])
def test_stacked_model_with_a_pretrained_frozen_extractor(reference, tmp_path, extractor, lookahead):
    """The extractor loads its checkpoint and never changes; the head trains as under single,
    with the extractor one batch ahead of the head (the default) or not."""
    import torch

    ckpt, state = extractor
    model = ["model=stacked", f"model.frozen_checkpoint={ckpt}"]
    ref = reference(cli.FAST + model)
    off = tmp_path / "offload"
    cli.run(cli.FAST + model + ["strategy=offload", f"strategy.lookahead={lookahead}", f"run_dir={off}"],
            cwd=tmp_path)
    cli.assert_same_training(off, ref)
    records = cli.metrics(off)
    if lookahead:  # every step but the first found its features computed ahead
        assert [r["offload_frozen_ahead"] for r in records] == [0.0] + [1.0] * (len(records) - 1)
    else:
        assert "offload_frozen_ahead" not in records[-1]
    final = cli.final_weights(off)
    for name, value in state.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=0)  # frozen: exactly the checkpoint
    assert final["head.0.fc.weight"].abs().sum() > 0


@pytest.mark.timeout(120)
def test_frozen_part_runs_while_the_head_trains(tmp_path):
    """The probe's head waits for the frozen part to start on the next batch: only an overlapped
    run gets through (without lookahead the same model stops with the probe's error)."""
    probe = ["model=custom", "model._target_=tests.user_model.ahead_probe", "+model.args.steps=6"]
    cli.run(cli.FAST + probe + ["strategy=offload", f"run_dir={tmp_path / 'ahead'}"], cwd=tmp_path)
    assert cli.metrics(tmp_path / "ahead")[-1]["offload_frozen_ahead"] == 1.0
    # Run serially the frozen part never starts ahead, however long the head waits: a short wait fails the same.
    proc = cli.run(cli.FAST + probe + ["strategy=offload", "strategy.lookahead=false", "+model.args.wait_s=1",
                                       f"run_dir={tmp_path / 'serial'}"], cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "the frozen part did not start on batch 2" in proc.stderr


@pytest.mark.timeout(200)
def test_peak_memory_is_bounded_by_block_size_and_prefetch(tmp_path):
    """16 blocks of 256 x 256: the offloaded peak is the buffer pool plus what the step itself
    allocates (activations, temporaries, and one block's gradients, which autograd makes before the
    engine moves them into a pool buffer), not the model's weights, gradients and AdamW state."""
    wide = ["model.args.hidden=256", "model.args.depth=16", "trainer.batch_size=8"]
    ref = tmp_path / "single"
    cli.run(cli.FAST + wide + [f"run_dir={ref}"], cwd=tmp_path)
    off = tmp_path / "offload"
    cli.run(cli.FAST + wide + ["strategy=offload", "strategy.prefetch=1", f"run_dir={off}"], cwd=tmp_path)
    single, offload = cli.metrics(ref)[-1], cli.metrics(off)[-1]
    weights = single["param_bytes_per_rank"][0]
    state = weights + single["optim_state_bytes_per_rank"][0] + weights  # + gradients
    step_own = single["mem_peak_bytes"] - state  # activations and temporaries of one step
    block = 256 * 256 * 4 + 256 * 4  # the largest block: one Linear(256, 256)
    pool = 4 * (1 + 1) + 2  # buffers for prefetch=1 (parallel.strategies.offload.engine), all allocated at the start
    assert offload["mem_peak_bytes"] <= (pool + 1) * block + step_own
    assert offload["mem_peak_bytes"] < single["mem_peak_bytes"] / 3


@pytest.mark.timeout(200)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak RSS is Linux's VmHWM")
def test_peak_rss_against_single_under_the_models_own_initialization(tmp_path):
    """benchmarks/offload.py's weights case, smaller (33.6M parameters in 32 blocks of 4 MiB) and under the default
    model.init=module, where rank 0 builds the whole model once to write its initial weights. Above the
    framework's own memory (a tiny model's run), single holds weights, gradients and two moments (4x the
    weights), offload about that model once (1x, 0.25; 0.19-0.20 measured), its blocks' buffers being small.
    Before the heap was trimmed when offload takes over (Note [host allocations]), the freed model stayed in the
    process beside the pages of the initial weights' file, read back a block at a time (2x): 0.43 here, and
    1,350 against 2,504 MiB (0.54x) at 134M parameters."""
    args = ["trainer.steps=2", "trainer.log_every=2", "trainer.progress=false", "trainer.batch_size=16",
            "trainer.clip_grad_norm=0"]
    model = ["model.args.hidden=1024", "model.args.depth=32"]
    peak = {}
    for name, extra in (("own", ["model.args.hidden=64"]), ("single", model),
                        ("offload", model + ["strategy=offload"])):
        cli.run(args + extra + [f"run_dir={tmp_path / name}"], cwd=tmp_path, fresh=True)  # a process of its own
        peak[name] = cli.metrics(tmp_path / name)[-1]["rss_peak_bytes"]
    ratio = (peak["offload"] - peak["own"]) / (peak["single"] - peak["own"])
    assert ratio < 0.35, (ratio, peak)


@pytest.mark.timeout(120)
def test_disk_files_are_removed_when_the_run_fails(tmp_path):
    proc = cli.run(cli.FAST + ["strategy=offload", "model=custom", "model._target_=tests.user_model.fails_late",
                               f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "boom in the middle of training" in proc.stderr
    assert not (tmp_path / "offload").exists()
