import os

import pytest

from tests import gpus

# Tiny models: one thread per process keeps multi-process tests from oversubscribing 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Nothing is downloaded: Hugging Face's hub offline, as the framework sets it once transformers is asked for
# (parallel/models/hf.py). Set here, before tests/cli.py takes the environment its zygote runs under, so that
# a test building a Hugging Face model in this process does not change that environment (and with it turn
# every later run into a new interpreter: tests/cli.py `_Zygote.serves`).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every test but the CUDA ones runs on the CPU, on a machine with GPUs too (Note [tests on a GPU machine] in
# tests/gpus.py); before anything initializes CUDA.
gpus.hide()


def pytest_runtest_setup(item):
    """`@pytest.mark.cuda` (one GPU) or `cuda(n)`: skipped, with the reason, where fewer GPUs are visible."""
    need = max((m.args[0] if m.args else 1 for m in item.iter_markers("cuda")), default=0)
    if need and gpus.count() < need:
        pytest.skip(f"needs {need} CUDA device{'s' if need > 1 else ''} ({gpus.count()} visible)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails, in setup or in its body, with the config error of a feature this older torch lacks is
    reported as skipped, that error its reason (Note [tests on older torch releases] in tests/releases.py)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and call.when in ("setup", "call"):
        from tests import releases  # imports torch: only once a test has failed, never before `gpus.hide`

        why = releases.too_old(str(call.excinfo.value))
        if why:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {why}")


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """A directory of this session shared by its pytest-xdist workers (each has its own basetemp below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def reference(shared_dir):
    """`reference(args)`: the run directory of `python launch/train.py *args`, run once in the session.

    Many tests compare against the same `strategy=single` run (one reference per model, STYLE.md 16); a
    module-scoped fixture would still run it once per module, and once per xdist worker.
    """
    from tests import cli

    def get(args: list[str], timeout: float = 180):
        return cli.shared_run(args, shared_dir / "references", timeout=timeout)

    return get


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """Small Hugging Face model directories (config.json and weights, as save_pretrained writes them), built
    from configs in tests/hf_models.py: nothing is downloaded. Their weights are the model's own
    initialization under seed 1 (a run with trainer.seed=0 would start elsewhere without loading them);
    `bert_base` holds an encoder without the masked-LM head (tests/hf_models.py bert_base)."""
    import torch

    from tests import hf_models

    root = tmp_path_factory.mktemp("hf")
    made = {}
    for name, factory in (("llama", hf_models.llama), ("gpt2", hf_models.gpt2), ("bert", hf_models.bert_classifier),
                          ("bert_base", hf_models.bert_base)):
        torch.manual_seed(1)
        factory().save_pretrained(root / name)
        made[name] = str(root / name)
    return made
