"""An epoch loop that calls the script's own train() and evaluate()."""
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

history = []


def train(model, loader, opt):
    model.train()
    total = 0.0
    for xb, yb in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        total += loss.item()
    history.append(total)
    return total / len(loader)


def evaluate(model, X, y):
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(X), 64):
            correct += (model(X[i:i + 64]).argmax(1) == y[i:i + 64]).sum().item()
    return correct / len(X)


torch.manual_seed(2)
torch.set_num_threads(1)
X, y = load_digits(return_X_y=True)
X = torch.tensor(X[:400], dtype=torch.float32) / 16
y = torch.tensor(y[:400])
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X[:300], y[:300]),
                                     batch_size=30)
net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
opt = torch.optim.SGD(net.parameters(), lr=0.3)
for epoch in range(3):
    train_loss = train(net, loader, opt)
    val_acc = evaluate(net, X[300:], y[300:])
    print(f"epoch {epoch} train_loss {train_loss:.6f} val_acc {val_acc:.6f} "
          f"history {len(history)}")
