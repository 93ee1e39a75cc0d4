"""A small hands-free trainer in the style of the PyTorch examples: digits,
an MLP with dropout, SGD with StepLR, its epoch loop in main(); saves the
final model.  benchmarks/elastic.py kills and resumes its records."""
import sys
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits


def train(model, loader, opt):
    model.train()
    total = 0.0
    for xb, yb in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        total += loss.item()
    return total


def main(epochs):
    torch.manual_seed(4)
    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X[:320], dtype=torch.float32) / 16
    y = torch.tensor(y[:320])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y),
                                         batch_size=32, shuffle=True)
    net = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(),
                              torch.nn.Dropout(0.3), torch.nn.Linear(48, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    best, history = 0.0, []
    print("data ready")
    for epoch in range(epochs):
        total = train(net, loader, opt)
        sched.step()
        net.eval()
        with torch.no_grad():
            acc = (net(X).argmax(1) == y).float().mean().item()
        best = max(best, acc)
        history.append(round(total, 6))
        print(f"epoch {epoch} loss {total:.6f} acc {acc:.6f} best {best:.6f} "
              f"noise {torch.rand(1).item():.6f}", flush=True)
    torch.save(net.state_dict(), "final.pt")
    print("best", best, "history", history)


if __name__ == "__main__":
    main(int(sys.argv[1]))
