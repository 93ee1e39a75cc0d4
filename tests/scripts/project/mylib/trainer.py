import time

import torch


class Trainer:
    """fit() runs the epochs, train_epoch() the batches; the script hands it
    callbacks, called after each epoch."""

    def __init__(self, model, opt, data, batch_size=32, callbacks=()):
        self.model, self.opt, self.data = model, opt, data
        self.batch_size = batch_size
        self.callbacks = list(callbacks)
        self.epoch = 0
        self.epoch_time = 0.0
        self.history = []

    def train_epoch(self):
        X, Y = self.data
        self.model.train()
        total, n = 0.0, 0
        for i in range(0, len(X), self.batch_size):
            x, y = X[i:i + self.batch_size], Y[i:i + self.batch_size]
            self.opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            total += loss.item() * len(x)
            n += len(x)
        return total / n

    def evaluate(self):
        X, Y = self.data
        self.model.eval()
        with torch.no_grad():
            return (self.model(X).argmax(1) == Y).float().mean().item()

    def fit(self, epochs):
        for epoch in range(epochs):
            t0 = time.time()
            loss = self.train_epoch()
            acc = self.evaluate()
            self.history.append(loss)
            self.epoch = epoch
            self.epoch_time = time.time() - t0
            print(f"epoch {epoch} loss {loss:.5f} acc {acc:.4f} in {self.epoch_time:.3f} s")
            for cb in self.callbacks:
                cb(self)
        return self.history
