"""Data-parallel training in the style of the PyTorch DDP examples: torchrun
starts the ranks, each builds a DistributedSampler shard of scikit-learn's
digits, a CNN wrapped in DistributedDataParallel (gloo on CPU), Adam and a
StepLR; rank 0 evaluates and saves the model.  Hands-free: no flor import."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


def train(model, loader, optimizer, epoch):
    model.train()
    total = 0.0
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / len(loader)


def evaluate(model, X, y):
    model.eval()
    with torch.no_grad():
        return (model(X).argmax(1) == y).float().mean().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    y = torch.tensor(y)
    data = TensorDataset(X[:1200], y[:1200])
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DDP(Net())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        loss = train(model, loader, optimizer, epoch)
        scheduler.step()
        acc = evaluate(model, X[1200:], y[1200:])
        print(f"rank {rank} epoch {epoch} loss {loss:.6f} acc {acc:.6f} "
              f"noise {torch.rand(1).item():.6f}", flush=True)
    if rank == 0:
        torch.save(model.module.state_dict(), "final.pt")
    # Every rank done before any tears the group down; the barrier's work is
    # kept to the end (KEEP). torch's gloo worker thread drops its reference
    # to a collective's work once it completes; were that the last one, it
    # would destroy the work, and the Python object the work holds, while
    # the interpreter finalizes, and the process aborts ("terminate called
    # without an active exception"; 1 plain torchrun run in 7 here).
    KEEP.append(dist.barrier(async_op=True))
    KEEP[-1].wait()
    dist.destroy_process_group()


KEEP = []  # objects that must live until the interpreter exits

if __name__ == "__main__":
    main()
