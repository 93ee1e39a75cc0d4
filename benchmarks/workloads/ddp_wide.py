"""A data-parallel trainer with a large state, for benchmarks/ranks.py:
torchrun ranks train a wide MLP (WIDTH x WIDTH layers, Adam) under
DistributedDataParallel on a DistributedSampler shard of scikit-learn's
digits.  Hands-free: flor records it unmodified.  Each rank prints the
seconds its epoch loop took."""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

def train(model, loader, optimizer):
    model.train()
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batches", type=int, default=4)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    X, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    loader = [b for _, b in zip(range(args.batches), loader)]
    hidden = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width),
                                                      nn.ReLU())]
    model = DDP(nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), *hidden,
                              nn.Linear(args.width, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        train(model, loader, optimizer)
    print(f"rank {dist.get_rank()} loop_s {time.perf_counter() - t0:.4f}", flush=True)
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
