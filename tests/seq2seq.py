"""An encoder-decoder as users bring one: a tiny Hugging Face T5 built from a config (nothing downloaded), its
dataset of dict samples fed to the forward by name (Note [inputs by name] in parallel/tensors.py), and the
user's own loop, the Hugging Face Trainer's way: `model(**batch).loss`, AdamW, clipping."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

VOCAB, SOURCE, TARGET = 48, 8, 6
FIELDS = ["input_ids", "attention_mask", "labels"]  # data.input_key: what the forward takes by name


def t5(vocab_size: int = VOCAB):
    """A 2+2-layer T5 of width 16 (pad and decoder start token 0, as T5's own)."""
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=vocab_size, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=False))


class Pairs(Dataset):
    """Source and target sequences of ids, padded: the source's tail masked, the target's tail -100 (not
    counted), at lengths that differ from sample to sample; the decoder's input beside them."""

    vocab_size = VOCAB

    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(3)
        self.source = torch.randint(1, VOCAB, (n, SOURCE), generator=g)
        self.target = torch.randint(1, VOCAB, (n, TARGET), generator=g)
        self.source_len = torch.randint(3, SOURCE + 1, (n,), generator=g)
        self.target_len = torch.randint(2, TARGET + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        mask = (torch.arange(SOURCE) < self.source_len[i]).long()
        labels = torch.where(torch.arange(TARGET) < self.target_len[i], self.target[i], -100)
        # The decoder's input: the labels shifted right behind the start token, as T5 makes it from labels.
        decoder = torch.cat([torch.zeros(1, dtype=torch.long), labels[:-1].clamp(min=0)])
        return {"input_ids": self.source[i] * mask, "attention_mask": mask, "labels": labels,
                "decoder_input_ids": decoder}


def pairs(n: int = 64) -> Pairs:
    return Pairs(n)


def plain_loop(path: str, batches: list[list[int]], lr: float = 5e-3, weight_decay: float = 0.01,
               clip: float = 1.0):
    """The user's own loop from `from_pretrained(path)` over the given batches of sample indices: the mean
    loss the model computes over the batch's counted labels. Returns (losses, final state)."""
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(path).train()
    data = Pairs()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for rows in batches:
        batch = {k: torch.stack([data[i][k] for i in rows]) for k in FIELDS}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), {k: v.detach().clone() for k, v in model.state_dict().items()}
