"""Language modelling: a character-level LSTM on the Python standard
library's own source files (shipped with Python: nothing is downloaded).
A plain training script (it does not import flor).

    python lm_lstm.py --epochs 6 [--save-dir DIR]
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def corpus(nbytes):
    """The first `nbytes` of the stdlib's .py files, in sorted order."""
    lib = os.path.dirname(os.__file__)
    text = []
    size = 0
    for name in sorted(os.listdir(lib)):
        if name.endswith(".py"):
            with open(os.path.join(lib, name), encoding="utf-8", errors="replace") as f:
                text.append(f.read())
            size += len(text[-1])
            if size >= nbytes:
                break
    return "".join(text)[:nbytes]


class CharLM(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.embed = nn.Embedding(vocab, 64)
        self.lstm = nn.LSTM(64, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        h, _ = self.lstm(self.embed(x))
        return self.out(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--save-dir", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    text = corpus(400_000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(len(data) * 0.9)
    seq, bs = 64, 32
    model = CharLM(len(chars), args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(1)
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for _ in range(args.batches):
            starts = torch.randint(0, split - seq - 1, (bs,), generator=gen)
            xb = torch.stack([data[s:s + seq] for s in starts])
            yb = torch.stack([data[s + 1:s + seq + 1] for s in starts])
            opt.zero_grad()
            loss = F.cross_entropy(model(xb).reshape(-1, len(chars)), yb.reshape(-1))
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total += loss.item()
        model.eval()
        with torch.no_grad():
            xv = data[split:split + 8 * seq].view(8, seq)
            yv = data[split + 1:split + 8 * seq + 1].view(8, seq)
            val = F.cross_entropy(model(xv).reshape(-1, len(chars)), yv.reshape(-1)).item()
        print(f"epoch {epoch} train_loss {total / args.batches:.4f} val_loss {val:.4f}")
        if args.save_dir:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.save_dir, f"epoch{epoch}.pt"))


if __name__ == "__main__":
    main()
