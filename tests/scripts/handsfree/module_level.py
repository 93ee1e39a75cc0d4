"""Module-level loops, manual batching, no functions."""
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

torch.manual_seed(0)
torch.set_num_threads(1)
X, y = load_digits(return_X_y=True)
X = torch.tensor(X[:320], dtype=torch.float32) / 16
y = torch.tensor(y[:320])
net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
seen = 0
for epoch in range(3):
    total = 0.0
    for i in range(0, len(X), 32):
        xb, yb = X[i:i + 32], y[i:i + 32]
        opt.zero_grad()
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        total += loss.item()
        seen += len(xb)
    acc = (net(X).argmax(1) == y).float().mean().item()
    print(f"epoch {epoch} loss {total:.6f} acc {acc:.6f} seen {seen}")
print(f"done: weight sum {net[0].weight.sum().item():.6f}")
