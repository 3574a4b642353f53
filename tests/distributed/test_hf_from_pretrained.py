"""model=hf of a directory that lacks some of the class's weights trains as the user's own loop started from
`torch.manual_seed(seed); AutoModelForMaskedLM.from_pretrained(dir)`: an encoder checkpoint (no masked-LM head,
an unused pooler) under single, data zero 3 and a pipeline on 2 ranks; the missing head starts from
from_pretrained's values (rank 0 builds it so, Note [initial values]), listed once, the pooler dropped."""
import pytest

from tests import cli
from tests.hf_models import DATA, HF_FAST, assert_as, plain_from_pretrained

STRATEGIES = {"single": [], "data_zero3": ["nproc=2", "strategy=data", "strategy.zero=3"],
              "pipeline": ["nproc=2", "strategy=pipeline"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_directory_missing_the_head_trains_as_from_pretrained(tmp_path, hf_dirs, strategy):
    path = hf_dirs["bert_base"]
    run = HF_FAST + ["model=hf", f"model.path={path}", "model.auto_class=AutoModelForMaskedLM"] + DATA["llama"][0]
    proc = cli.run(run + STRATEGIES[strategy] + [f"run_dir={tmp_path}"], cwd=tmp_path, timeout=180)
    assert_as(tmp_path, plain_from_pretrained(path, "AutoModelForMaskedLM"))
    said = proc.stdout + proc.stderr
    assert said.count("lack; from_pretrained's initial values for 5 tensors") == 1, said[-3000:]
    assert said.count("hold, ignored: 2 tensors (pooler.dense.bias, pooler.dense.weight)") == 1
    assert "LOAD REPORT" not in said  # transformers' own listing, silenced: the framework's is the one
