import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)


def recorder(store, name):
    """A hook that keeps the mean activation of a layer under its name."""
    def hook(module, inputs, output):
        store.setdefault(name, []).append(output.detach().abs().mean().item())
    return hook


class Trainer:
    """Activation statistics kept by forward hooks: a bound method of the
    trainer, a lambda, and a closure a factory makes."""

    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)
        self.calls = 0
        self.peaks = []
        self.acts = {}
        model[0].register_forward_hook(self._count)
        model[1].register_forward_hook(lambda m, i, o: self.peaks.append(o.max().item()))
        model[2].register_forward_hook(recorder(self.acts, "head"))

    def _count(self, module, inputs, output):
        self.calls += 1

    def train_epoch(self, X, Y):
        for i in range(0, len(X), 32):
            self.opt.zero_grad()
            F.cross_entropy(self.model(X[i:i + 32]), Y[i:i + 32]).backward()
            self.opt.step()

    def fit(self, X, Y, epochs):
        for epoch in range(epochs):
            self.train_epoch(X, Y)
            print(f"epoch {epoch} calls {self.calls} peak {self.peaks[-1]:.4f} "
                  f"head {len(self.acts['head'])} {self.acts['head'][-1]:.4f}")


torch.manual_seed(0)
X = torch.randn(192, 8)
Y = (X[:, 0] > X[:, 1]).long()
Trainer(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))).fit(X, Y, 5)
