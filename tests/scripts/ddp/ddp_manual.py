"""Data-parallel training with flor's manual API, launched by torchrun
itself (``torchrun --nproc_per_node 2 ddp_manual.py``), shaped like the
PyTorch DDP examples (setup, a training function, cleanup): an MLP on a
DistributedSampler shard of scikit-learn's digits, DistributedDataParallel
over gloo, SGD with momentum; every rank logs its loss."""
import sys

import flor
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

def load_data():
    X, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    return DataLoader(data, batch_size=64, sampler=sampler), sampler


def train(epochs):
    rank = dist.get_rank()
    loader, sampler = load_data()
    model = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2),
                              nn.Linear(64, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in flor.generator(range(epochs), state=(model, optimizer)):
        sampler.set_epoch(epoch)
        total = 0.0
        if flor.SkipBlock.step_into("train"):
            model.train()
            for x, t in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), t)
                loss.backward()
                optimizer.step()
                total += loss.item()
        model, optimizer, total = flor.SkipBlock.end(model, optimizer, total)
        flor.log("loss", total)
        print(f"rank {rank} epoch {epoch} loss {total:.6f} draw {torch.randn(1).item():.6f}",
              flush=True)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(1)
    torch.set_num_threads(1)
    train(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
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
