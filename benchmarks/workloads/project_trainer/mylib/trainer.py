import time

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader


class Trainer:
    """fit() runs the epochs; each trains (train_epoch), evaluates, steps
    the schedule and calls the callbacks the script gave it."""

    def __init__(self, model, train, test, lr=1.0, batch_size=64, callbacks=()):
        self.model = model
        self.optimizer = torch.optim.Adadelta(model.parameters(), lr=lr)
        self.scheduler = StepLR(self.optimizer, step_size=1, gamma=0.7)
        self.train_loader = DataLoader(train, batch_size=batch_size, shuffle=True)
        self.test_loader = DataLoader(test, batch_size=1000)
        self.callbacks = list(callbacks)
        self.epoch = 0
        self.accuracies = []

    def train_epoch(self):
        self.model.train()
        total = 0.0
        for data, target in self.train_loader:
            self.optimizer.zero_grad()
            loss = F.nll_loss(self.model(data), target)
            loss.backward()
            self.optimizer.step()
            total += loss.item() * len(target)
        return total / len(self.train_loader.dataset)

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        correct = 0
        for data, target in self.test_loader:
            correct += (self.model(data).argmax(1) == target).sum().item()
        return correct / len(self.test_loader.dataset)

    def fit(self, epochs):
        for epoch in range(epochs):
            start = time.time()
            loss = self.train_epoch()
            accuracy = self.evaluate()
            self.scheduler.step()
            self.epoch = epoch
            self.accuracies.append(accuracy)
            print(f"epoch {epoch} loss {loss:.4f} accuracy {accuracy:.4f} "
                  f"time {time.time() - start:.2f}s")
            for callback in self.callbacks:
                callback(self)
