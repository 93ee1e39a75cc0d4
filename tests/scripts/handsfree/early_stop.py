"""A while loop with early stopping on validation accuracy."""
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

torch.manual_seed(3)
torch.set_num_threads(1)
X, y = load_digits(return_X_y=True)
X = torch.tensor(X[:400], dtype=torch.float32) / 16
y = torch.tensor(y[:400])
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
epoch, best, stale = 0, 0.0, 0
while epoch < 40 and best < 0.8:
    for i in range(0, 300, 25):
        opt.zero_grad()
        loss = F.cross_entropy(model(X[i:i + 25]), y[i:i + 25])
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model(X[300:]).argmax(1) == y[300:]).float().mean().item()
    if acc > best:
        best, stale = acc, 0
    else:
        stale += 1
    print(f"epoch {epoch} val_acc {acc:.6f} best {best:.6f} stale {stale}")
    epoch += 1
print(f"stopped after {epoch} epochs")
