"""Datasets a user would write, for data=custom tests: importable by the workers (tests.user_data.<name>)."""
from __future__ import annotations

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


def not_a_dataset(**kwargs) -> list:
    return [(torch.zeros(8), torch.zeros(2))] * 64


def take_first_two(samples: list) -> dict:
    """A collate function: a dict batch built from tuple samples."""
    return {"x": torch.stack([s[0] for s in samples]), "y": torch.stack([s[1] for s in samples])}
