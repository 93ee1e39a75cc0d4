"""Checkpoint a real training run without stopping it, then resume from the checkpoint.

A small CNN learns scikit-learn's bundled handwritten digits (8x8 images that
ship inside the package: nothing is downloaded).  After epoch 3 the model,
optimizer, scheduler and random-number state go to a flor.Materializer; the
training thread returns to work after a memory copy while a writer thread
makes the file durable.  Training goes on to epoch 6.  Then the checkpoint is
loaded into fresh objects and epochs 4-6 are run again: the weights come out
bit for bit the same as the first run's.
"""
import os
import tempfile
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flor

EPOCHS, CHECKPOINT_AT = 6, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                                  nn.Dropout(0.2), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.features(x))


def digits():
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def make(train):
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = DataLoader(TensorDataset(*train), batch_size=64, shuffle=True)
    return model, opt, sched, loader


def train_epoch(model, opt, sched, loader):
    model.train()
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    sched.step()


@torch.no_grad()
def accuracy(model, test):
    model.eval()
    x, y = test
    return (model(x).argmax(1) == y).float().mean().item()


def main():
    torch.set_num_threads(1)
    train, test = digits()
    torch.manual_seed(0)
    model, opt, sched, loader = make(train)
    with tempfile.TemporaryDirectory() as ckpts:
        with flor.Materializer(ckpts) as m:
            for epoch in range(1, EPOCHS + 1):
                train_epoch(model, opt, sched, loader)
                print(f"epoch {epoch}: test accuracy {accuracy(model, test):.3f}")
                if epoch == CHECKPOINT_AT:
                    state = {"model": model, "optimizer": opt, "scheduler": sched,
                             "rng": torch.get_rng_state(), "epoch": epoch}
                    t0 = time.perf_counter()
                    m.submit(f"epoch-{epoch}", state)
                    blocked = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    m.flush()
                    durable = blocked + time.perf_counter() - t0
                    rng_after = torch.get_rng_state()
                    t0 = time.perf_counter()
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "scheduler": sched.state_dict(), "rng": rng_after},
                               os.path.join(ckpts, "torch-save.pt"))
                    torch_save = time.perf_counter() - t0
                    print(f"  checkpoint: training blocked {blocked * 1e3:.2f} ms "
                          f"(durable after {durable * 1e3:.1f} ms); "
                          f"torch.save of the same state blocked {torch_save * 1e3:.1f} ms")
        first_run = {k: v.clone() for k, v in model.state_dict().items()}

        # Resume from the checkpoint in fresh objects.
        path = os.path.join(ckpts, f"epoch-{CHECKPOINT_AT}.flor")
        saved = flor.load(path)
        model2, opt2, sched2, loader2 = make(train)
        flor.restore([model2, opt2, sched2], [saved["model"], saved["optimizer"], saved["scheduler"]])
        torch.set_rng_state(saved["rng"])
        print(f"restored {os.path.basename(path)} ({os.path.getsize(path)} bytes): "
              f"test accuracy {accuracy(model2, test):.3f}")
        for epoch in range(saved["epoch"] + 1, EPOCHS + 1):
            train_epoch(model2, opt2, sched2, loader2)
            print(f"resumed epoch {epoch}: test accuracy {accuracy(model2, test):.3f}")
    same = all(torch.equal(v, model2.state_dict()[k]) for k, v in first_run.items())
    print(f"resumed weights equal the uninterrupted run's, bit for bit: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
