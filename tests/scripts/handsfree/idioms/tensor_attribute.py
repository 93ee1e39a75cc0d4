import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)


class CenteredHead(nn.Module):
    """Logits of features less a running center that forward() keeps as a
    plain tensor attribute (no buffer: no state dict holds it)."""

    def __init__(self, d_in, d_hidden, classes):
        super().__init__()
        self.encoder = nn.Linear(d_in, d_hidden)
        self.head = nn.Linear(d_hidden, classes)
        self.center = torch.zeros(d_hidden)
        self.steps = 0

    def forward(self, x):
        h = torch.relu(self.encoder(x))
        if self.training:
            self.center = 0.9 * self.center + 0.1 * h.detach().mean(0)
            self.steps += 1
        return self.head(h - self.center)


def train(model, opt, X, Y):
    model.train()
    for i in range(0, len(X), 32):
        opt.zero_grad()
        F.cross_entropy(model(X[i:i + 32]), Y[i:i + 32]).backward()
        opt.step()


torch.manual_seed(0)
X = torch.randn(192, 8)
Y = (X[:, 0] > X[:, 1]).long()
model = CenteredHead(8, 16, 2)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(5):
    train(model, opt, X, Y)
    model.eval()
    with torch.no_grad():
        acc = (model(X).argmax(1) == Y).float().mean().item()
    print(f"epoch {epoch} acc {acc:.4f}")
