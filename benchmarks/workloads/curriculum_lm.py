"""Sequence-length warm-up: a small character-level transformer trained on
the Python standard library's own source files (shipped with Python:
nothing is downloaded), whose training sequences grow longer every epoch,
so that each epoch takes longer than the one before (the curriculum that
large language-model trainers use to start on short sequences).
A plain training script (it does not import flor).

    python curriculum_lm.py --epochs 10 [--batches 24]
"""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def stdlib_text(nbytes):
    lib = os.path.dirname(os.__file__)
    parts, size = [], 0
    for name in sorted(os.listdir(lib)):
        if name.endswith(".py") and size < nbytes:
            with open(os.path.join(lib, name), encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
            size += len(parts[-1])
    return "".join(parts)[:nbytes]


class TinyTransformer(nn.Module):
    def __init__(self, vocab, width, layers, max_len=1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.tok(x) + self.pos(torch.arange(t))
        return self.head(self.body(h, mask=mask, is_causal=True))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--start-len", type=int, default=48)
    p.add_argument("--grow", type=int, default=12, help="sequence length added per epoch")
    args = p.parse_args()
    torch.manual_seed(0)
    text = stdlib_text(300_000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    model = TinyTransformer(len(chars), args.width, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for epoch in range(args.epochs):
        seq = args.start_len + args.grow * epoch
        total = 0.0
        for _ in range(args.batches):
            starts = torch.randint(0, len(data) - seq - 1, (16,), generator=gen)
            x = torch.stack([data[s:s + seq] for s in starts])
            y = torch.stack([data[s + 1:s + seq + 1] for s in starts])
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        print(f"epoch {epoch} seq {seq} loss {total / args.batches:.4f} "
              f"ppl {math.exp(total / args.batches):.2f}")


if __name__ == "__main__":
    main()
