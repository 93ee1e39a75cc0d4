"""A class-based trainer, as many projects write one: a Trainer object owns
the model, optimizer, scheduler and data loaders; fit() runs the epochs and
calls train_epoch() and evaluate() methods; the trainer keeps a global step,
a history and the best weights.  A small CNN on scikit-learn's bundled
digits (nothing is downloaded).  A plain training script (it does not
import flor).

    python trainer_class.py --epochs 6
"""
import argparse
import copy
import gzip
import importlib.util
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def load_digits(limit):
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)[:limit]
    x = torch.from_numpy(table[:, :64]).reshape(-1, 1, 8, 8) / 16.0
    x = F.interpolate(x, size=(24, 24), mode="bilinear", align_corners=False)
    y = torch.from_numpy(table[:, 64]).long()
    split = int(0.8 * len(y))
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


class ConvNet(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2))
        self.head = nn.Linear(2 * width * 36, 10)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


class Trainer:
    def __init__(self, model, train_set, val_set, lr, batch_size, epochs):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                         weight_decay=5e-4)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, epochs)
        self.train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
        self.val_loader = DataLoader(val_set, batch_size=256)
        self.epochs = epochs
        self.global_step = 0
        self.history = {"train_loss": [], "val_acc": []}
        self.best_acc = 0.0
        self.best_state = None

    def train_epoch(self, epoch):
        self.model.train()
        running = 0.0
        for x, y in self.train_loader:
            self.optimizer.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            self.global_step += 1
            running += loss.item() * len(y)
        return running / len(self.train_loader.dataset)

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        correct = 0
        for x, y in self.val_loader:
            correct += (self.model(x).argmax(1) == y).sum().item()
        return correct / len(self.val_loader.dataset)

    def fit(self):
        for epoch in range(self.epochs):
            train_loss = self.train_epoch(epoch)
            val_acc = self.evaluate()
            self.scheduler.step()
            self.history["train_loss"].append(train_loss)
            self.history["val_acc"].append(val_acc)
            if val_acc > self.best_acc:
                self.best_acc = val_acc
                self.best_state = copy.deepcopy(self.model.state_dict())
            print(f"epoch {epoch}: step {self.global_step} train_loss {train_loss:.4f} "
                  f"val_acc {val_acc:.4f} lr {self.scheduler.get_last_lr()[0]:.5f}")
        return self.history


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--limit", type=int, default=1797)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train_set, val_set = load_digits(args.limit)
    trainer = Trainer(ConvNet(args.width), train_set, val_set, 0.05, args.batch_size, args.epochs)
    history = trainer.fit()
    print(f"best val_acc {trainer.best_acc:.4f} after {trainer.global_step} steps; "
          f"final train_loss {history['train_loss'][-1]:.4f}")


if __name__ == "__main__":
    main()
