"""Datasets a user would write, for data=custom tests: importable by the workers (tests.user_data.<name>)."""
from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset, IterableDataset


def _teacher(features: int, targets: int) -> torch.Tensor:
    return torch.randn(features, targets, generator=torch.Generator().manual_seed(7)) / features ** 0.5


class Regression(Dataset):
    """n samples of `features` floats and `targets` floats (a noisy linear teacher), as (x, y) tuples."""

    def __init__(self, n: int = 96, features: int = 8, targets: int = 2, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        self.y = self.x @ _teacher(features, targets) + 0.01 * torch.randn(n, targets, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def regression(n: int = 96, features: int = 8, targets: int = 2, seed: int = 0) -> Regression:
    return Regression(n, features, targets, seed)


def poisoned(n: int = 96, features: int = 8, targets: int = 2, batch: int = 8, steps: tuple = (3,),
             seed: int = 0) -> Regression:
    """`regression`, with one NaN target in the global batch of each of `steps` (the data read in order,
    data.shuffle=false, `batch` samples a step): a loss that is not finite at chosen steps, under any strategy."""
    ds = Regression(n, features, targets, seed)
    for step in steps:
        ds.y[((step - 1) * batch) % n, 0] = float("nan")
    return ds


def hf_classification(n: int = 96, features: int = 8, classes: int = 3):
    """A Hugging Face datasets.Dataset built in memory: dict samples {'x': floats, 'labels': int}, a
    ClassLabel feature stating the number of classes."""
    import datasets

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, features, generator=g)
    labels = (x @ _teacher(features, classes)).argmax(dim=1)
    features_spec = datasets.Features({"x": datasets.Sequence(datasets.Value("float32"), length=features),
                                       "labels": datasets.ClassLabel(num_classes=classes)})
    return datasets.Dataset.from_dict({"x": x.tolist(), "labels": labels.tolist()}, features=features_spec)


class Stream(IterableDataset):
    """A stream of dict samples {'x': floats, 'y': floats}, the i-th drawn from a generator seeded by i (endless,
    or `length` long); with state_dict / load_state_dict (its position) when `stateful`. Iterating starts at
    the beginning, or where load_state_dict said."""

    def __init__(self, features: int = 8, targets: int = 2, length: int = 0):
        self.features, self.targets, self.length = features, targets, length
        self.teacher = _teacher(features, targets)
        self.position, self.start = 0, 0

    def __iter__(self):
        i, self.start = self.start, 0
        self.started_at = i  # where the last iteration began (tests: resumed from a state, or from 0)
        while not self.length or i < self.length:
            x = torch.randn(self.features, generator=torch.Generator().manual_seed(1000 + i))
            i += 1
            self.position = i
            yield {"x": x, "y": x @ self.teacher}


class StatefulStream(Stream):
    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["position"]


def stream(features: int = 8, targets: int = 2, stateful: bool = False, length: int = 0) -> Stream:
    return (StatefulStream if stateful else Stream)(features, targets, length)


def sharded_sample(shard: int, epoch: int, i: int, features: int = 8, targets: int = 2) -> dict:
    """Element i of a Sharded stream's shard in that shard's epoch."""
    x = torch.randn(features, generator=torch.Generator().manual_seed(10_000 * shard + 100 * epoch + i))
    return {"x": x, "y": x @ _teacher(features, targets)}


class Sharded(IterableDataset):
    """A stream that splits: `n_shards` shards, shard s `length + s` samples long (`sharded_sample`, by the
    epoch `set_epoch` set); `shard(n_shards, s)` gives shard s alone, which appends "<parent pid> <pid> <s>
    <epoch> <first element>" to the file `log` (when given) each time it is iterated. Iterated whole, it gives its shards one after
    the other. With state_dict / load_state_dict (its position in its epoch) when `stateful`."""

    def __init__(self, features: int = 8, targets: int = 2, shards: int = 4, length: int = 20,
                 log: str | None = None, only: int | None = None):
        self.features, self.targets, self.shards, self.length, self.log = features, targets, shards, length, log
        self.only, self.n_shards = only, shards if only is None else 1
        self.epoch, self.position, self.start = 0, 0, 0

    def shard(self, num_shards: int, index: int) -> Sharded:
        if num_shards != self.n_shards:
            raise ValueError(f"splits into its {self.n_shards} shards only")
        return type(self)(self.features, self.targets, self.shards, self.length, self.log, index)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.only is None:
            for s in range(self.shards):
                for i in range(self.length + s):
                    yield sharded_sample(s, 0, i, self.features, self.targets)
            return
        i, self.start = self.start, 0
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{os.getppid()} {os.getpid()} {self.only} {self.epoch} {i}\n")
        while i < self.length + self.only:
            i += 1
            self.position = i
            yield sharded_sample(self.only, self.epoch, i - 1, self.features, self.targets)


class StatefulSharded(Sharded):
    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.start, self.position = state["position"], state["position"]


def sharded(features: int = 8, targets: int = 2, shards: int = 4, length: int = 20, log: str | None = None,
            stateful: bool = False) -> Sharded:
    return (StatefulSharded if stateful else Sharded)(features, targets, shards, length, log)


class BadShards(Sharded):
    """A stream whose n_shards or shard() a run cannot use (bad-input tests)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "count":
            self.n_shards = "four"

    def shard(self, num_shards: int, index: int):
        if self.kind == "raises":
            raise ValueError("no shard here")
        return 4 if self.kind == "number" else super().shard(num_shards, index)


def bad_shards(kind: str) -> BadShards:
    return BadShards(kind)


class Tokens(Dataset):
    """Language-model samples {'input_ids': ids, 'labels': the next ids}; states its vocabulary size."""

    vocab_size = 16

    def __init__(self, n: int = 64, seq_len: int = 6):
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, self.vocab_size, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:], "text": f"sample {i}"}


class Listed(Dataset):
    """Fixed samples given as a list (bad-input tests: shapes a model cannot take, unnamed sizes)."""

    def __init__(self, samples: list):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return self.samples[i]


def images(n: int = 64) -> Listed:
    """(3, 4, 4) images: a model taking flat features cannot take them."""
    return Listed([(torch.zeros(3, 4, 4), torch.zeros(2))] * n)


def scalar_targets(n: int = 64) -> Listed:
    """Regression targets of shape (): the built-in models give (batch, targets)."""
    return Listed([(torch.zeros(8), torch.tensor(1.0))] * n)


def labels(n: int = 64) -> Listed:
    """Integer labels 0..2 (the first sample's is 2), without saying how many classes there are."""
    return Listed([(torch.zeros(8), (i + 2) % 3) for i in range(n)])


def wide(n: int = 64) -> Listed:
    """Samples of 9 features (another shape than regression()'s 8)."""
    return Listed([(torch.zeros(9), torch.zeros(2))] * n)


def _rows(n: int):
    for i in range(n):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        yield {"x": x.tolist(), "y": (x[:2] * 2).tolist()}


def hf_stream(n: int = 200):
    """A Hugging Face datasets.IterableDataset (it has state_dict / load_state_dict)."""
    import datasets

    return datasets.IterableDataset.from_generator(_rows, gen_kwargs={"n": n})


def _shard_rows(shards: list, n: int):
    for s in shards:
        for i in range(n):
            x = torch.randn(8, generator=torch.Generator().manual_seed(100 * s + i))
            yield {"x": x.tolist(), "y": (x[:2] * 2).tolist(), "shard": s}


def hf_sharded_stream(shards: int = 4, n: int = 30):
    """A Hugging Face datasets.IterableDataset of `shards` shards (the list in gen_kwargs), `n` rows each."""
    import datasets

    return datasets.IterableDataset.from_generator(_shard_rows, gen_kwargs={"shards": list(range(shards)), "n": n})


def not_a_dataset(**kwargs) -> list:
    return [(torch.zeros(8), torch.zeros(2))] * 64


def take_first_two(samples: list) -> dict:
    """A collate function: a dict batch built from tuple samples."""
    return {"x": torch.stack([s[0] for s in samples]), "y": torch.stack([s[1] for s in samples])}


def stack_fields(samples: list) -> dict:
    """A collate function of dict samples: each field stacked."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
