"""def main() with argparse, behind the __main__ guard; Adam; a running best."""
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    torch.manual_seed(1)
    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X[:320], dtype=torch.float32) / 16
    y = torch.tensor(y[:320])
    model = torch.nn.Sequential(torch.nn.Linear(64, 24), torch.nn.Tanh(), torch.nn.Linear(24, 10))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    best = 0.0
    steps = 0
    for epoch in range(args.epochs):
        model.train()
        for i in range(0, len(X), 40):
            xb, yb = X[i:i + 40], y[i:i + 40]
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            steps += 1
        model.eval()
        with torch.no_grad():
            acc = (model(X).argmax(1) == y).float().mean().item()
        best = max(best, acc)
        print(f"epoch {epoch} acc {acc:.6f} best {best:.6f} steps {steps}")


if __name__ == "__main__":
    main()
