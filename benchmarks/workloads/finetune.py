"""Fine-tuning: a large frozen backbone (5 dense 4096x4096 blocks, 336 MB of
float32 parameters) with a small trainable head, short epochs, on
scikit-learn's digits.  The backbone is randomly initialised from a fixed
seed (no pretrained weights can be downloaded here); what matters for
checkpointing is its size: the script's own per-epoch torch.save writes all
of it, while training touches only the head.  A plain training script.

    python finetune.py --epochs 16 [--save-dir DIR]
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits


class Classifier(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.backbone = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(),
                                                      nn.LayerNorm(width))
                                        for _ in range(depth)])
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(width, 10))

    def forward(self, x):
        return self.head(self.backbone(self.embed(x)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--save-dir", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32) / 16
    y = torch.tensor(y)
    model = Classifier(args.width, args.depth)
    for p_ in list(model.embed.parameters()) + list(model.backbone.parameters()):
        p_.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.02, momentum=0.9)
    bs = 64
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for b in range(args.batches):
            i = (epoch * args.batches + b) * bs % (len(X) - 400 - bs)
            opt.zero_grad()
            loss = F.cross_entropy(model(X[i:i + bs]), y[i:i + bs])
            loss.backward()
            opt.step()
            total += loss.item()
        model.eval()
        with torch.no_grad():
            acc = (model(X[-400:]).argmax(1) == y[-400:]).float().mean().item()
        print(f"epoch {epoch} train_loss {total / args.batches:.4f} val_acc {acc:.4f}")
        if args.save_dir:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.save_dir, f"epoch{epoch}.pt"))


if __name__ == "__main__":
    main()
