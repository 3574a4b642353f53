"""An encoder-decoder (Hugging Face T5) trains from dict samples whose fields go to the forward by name (Note
[inputs by name] in parallel/tensors.py) as the user's own loop, the Hugging Face Trainer's way
(`model(**batch).loss`: the mean over the batch's counted labels, padding of other lengths in every
sample), under single with gradient accumulation, data zero 3 on 2 ranks and offload; the strategies that
take one input tensor refuse it in one line."""
import functools

import pytest

from tests import cli, parity
from tests.seq2seq import FIELDS, plain_loop, t5

BASE = ["model=hf", "model.auto_class=AutoModelForSeq2SeqLM", "data=custom", "data._target_=tests.seq2seq.pairs",
        f"data.input_key=[{','.join(FIELDS)}]", "data.target_key=labels", "data.shuffle=false",
        "trainer.steps=4", "trainer.batch_size=8", "trainer.log_every=1", "trainer.progress=false",
        "trainer.save_final=true", "optim.schedule=constant", *cli.TIMEOUTS]
STRATEGIES = {"single_accum": ["trainer.grad_accum=2"], "data_zero3": ["nproc=2", "strategy=data", "strategy.zero=3"],
              "offload": ["strategy=offload"]}


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("t5") / "t5"
    torch.manual_seed(1)
    t5().save_pretrained(path)
    return str(path)


@functools.lru_cache(maxsize=None)
def reference(path: str):
    # data.shuffle=false: global batch k holds samples 8(k-1) .. 8k-1.
    return plain_loop(path, [list(range(8 * k, 8 * k + 8)) for k in range(4)])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_t5_trains_as_the_users_loop(tmp_path, t5_dir, strategy):
    proc = cli.run(BASE + [f"model.path={t5_dir}", *STRATEGIES[strategy], f"run_dir={tmp_path}"], cwd=tmp_path)
    losses, state = reference(t5_dir)
    parity.assert_same_losses(cli.losses(tmp_path), losses)
    parity.assert_same_weights(cli.final_weights(tmp_path), state, parity.run_reach(tmp_path))
    assert "loss.name=output" not in proc.stderr  # the default: the targets go to the forward


BAD = {
    "pipeline": (["nproc=2", "strategy=pipeline"], "config error: data.input_key=['input_ids', 'attention_mask', "
                 "'labels']: fields passed by name train under single, data and offload; strategy.pp=2 traces"),
    "no_labels": (["data.input_key=[input_ids,attention_mask,decoder_input_ids]", "loss.name=output"],
                  "config error: loss.name='output': fails on the model's output and the data's targets: ValueError: "
                  "loss.name=output takes the loss the model computes, and its output (Seq2SeqLMOutput) holds none"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(BAD))
def test_what_cannot_take_fields_by_name_is_one_line_exit_2(tmp_path, t5_dir, name):
    args, line = BAD[name]
    proc = cli.run(BASE + [f"model.path={t5_dir}", *args, f"run_dir={tmp_path / 'run'}"], cwd=tmp_path,
                   check=False)
    assert proc.returncode == 2, proc.stderr
    (only,) = proc.stderr.splitlines()
    assert only.startswith(line), only
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
