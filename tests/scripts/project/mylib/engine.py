"""Training and evaluation helpers the script imports, in the shape of the
PyTorch reference scripts' engine.py."""
import time

import torch


class SmoothedValue:
    def __init__(self):
        self.total, self.count = 0.0, 0

    def update(self, value, n=1):
        self.total += value * n
        self.count += n

    @property
    def avg(self):
        return self.total / max(self.count, 1)


def train_one_epoch(model, optimizer, loader, epoch, print_freq=20):
    model.train()
    meter = SmoothedValue()
    start = time.time()
    for i, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        meter.update(loss.item(), len(x))
        if i % print_freq == 0:
            print(f"Epoch: [{epoch}] [{i}/{len(loader)}] loss {meter.avg:.4f}")
    print(f"Epoch: [{epoch}] total time {time.time() - start:.3f} s")
    return meter.avg


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    correct = total = 0
    for x, y in loader:
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    return correct / total
