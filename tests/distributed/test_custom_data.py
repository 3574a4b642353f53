"""data=custom: a user's map-style Dataset, a Hugging Face datasets.Dataset and an IterableDataset train under
every strategy as under strategy=single (the global batch of step k the same on any world size), and a run
saved under data zero 3 on two ranks resumes on one as the uninterrupted run continues (a stream that splits
into shards: read in disjoint parts by the ranks' loader workers, resumed from every shard's state)."""
from collections import defaultdict

import pytest
import torch

from tests import cli

# Six steps of 32 over 96 samples: two epochs of the map-style sets. Loaded in 2 processes, in this process
# (workers=0) and, for the stream, in one loader process with its state in the checkpoints.
DATASETS = {
    "map": ["data=custom", "data._target_=tests.user_data.regression"],
    "hf": ["data=custom", "data._target_=tests.user_data.hf_classification", "data.workers=0"],
    "stream": ["data=custom", "data._target_=tests.user_data.stream", "+data.args.stateful=true"],
    # 4 shards of 20..23 samples, each read by one of its rank's 2 loader workers (Note [custom data]).
    "sharded": ["data=custom", "data._target_=tests.user_data.sharded", "+data.args.stateful=true",
                "data.workers=2"],
}
BASE = cli.FAST + ["model.args.depth=2", "trainer.checkpoint_every=3"]
STRATEGIES = {"data0": ["strategy=data", "strategy.zero=0"], "pipeline": ["strategy=pipeline"],
              "model": ["strategy=model"]}


@pytest.fixture
def single(reference):
    return lambda name: reference(BASE + DATASETS[name])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("name", ["map", "hf", "stream"])
def test_custom_data_matches_single(single, tmp_path, name, strategy):
    cli.run(BASE + DATASETS[name] + ["nproc=2", *STRATEGIES[strategy], f"run_dir={tmp_path}"], cwd=tmp_path)
    cli.assert_same_training(tmp_path, single(name))


# The split stream's resume stands for the whole stream's here (one stream run; the whole stream resumes on
# two ranks in tests/unit/test_custom_data.py, and trains on two under every strategy above).
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["map", "hf", "sharded"])
def test_zero3_matches_single_and_resumes_on_single(single, tmp_path, name):
    """Saved at step 3 by data zero 3 on two ranks, resumed by strategy=single: steps 4..6 and the final
    weights of the uninterrupted single run (the next batch, the stream's state)."""
    ref, saved, resumed = single(name), tmp_path / "zero3", tmp_path / "resumed"
    log = tmp_path / "reads.log"  # the split stream's: "<rank pid> <loader pid> <shard> <epoch> <first>"
    cli.run(BASE + DATASETS[name] + ["nproc=2", "strategy=data", "strategy.zero=3", f"run_dir={saved}"]
            + ([f"+data.args.log={log}"] if name == "sharded" else []), cwd=tmp_path)
    cli.assert_same_training(saved, ref)
    checkpoint = saved / "checkpoints" / "step-000003"
    assert (checkpoint / "data.pt").is_file() == (name == "sharded")
    if name == "sharded":
        _assert_disjoint_reads(log)
        shards = torch.load(checkpoint / "data.pt", weights_only=False)["states"][3]["shards"]
        assert {s: shards[s]["element"] for s in shards} == {0: 24, 1: 24, 2: 24, 3: 24}  # of 96 positions
    cli.run(BASE + DATASETS[name] + [f"trainer.resume={checkpoint}", f"run_dir={resumed}"], cwd=tmp_path)
    assert [r["step"] for r in cli.metrics(resumed)] == [4, 5, 6]
    cli.assert_same_training(resumed, ref, first_step=4)


def _assert_disjoint_reads(log):
    """Each shard read by one loader process, the two ranks' shards disjoint, two shards a rank."""
    readers, by_rank = defaultdict(set), defaultdict(set)
    for line in log.read_text().splitlines():
        rank, loader, shard, _, _ = line.split()
        readers[int(shard)].add(loader)
        by_rank[rank].add(int(shard))
    assert sorted(readers) == [0, 1, 2, 3] and all(len(p) == 1 for p in readers.values()), dict(readers)
    assert len(by_rank) == 2 and sorted(s for shards in by_rank.values() for s in shards) == [0, 1, 2, 3]
    assert len({p for s in readers.values() for p in s}) == 4  # 2 loader workers a rank


@pytest.mark.timeout(120)
def test_a_sample_the_model_cannot_take_stops_before_any_worker(tmp_path):
    proc = cli.run(cli.FAST + ["data=custom", "data._target_=tests.user_data.images", "nproc=2", "strategy=data",
                               f"run_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error: data.input_key='0': the model does not take the dataset's "
                                  "regression samples (field '0': torch.float32 features of shape (3, 4, 4))")
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.jsonl").exists()
