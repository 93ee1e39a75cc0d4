import argparse

import torch
from sklearn.datasets import load_digits

from mylib import engine
from mylib.engine import evaluate


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32) / 16
    y = torch.tensor(y)
    train = torch.utils.data.TensorDataset(X[:1400], y[:1400])
    test = torch.utils.data.TensorDataset(X[1400:], y[1400:])
    train_loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test, batch_size=128)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for epoch in range(args.epochs):
        loss = engine.train_one_epoch(model, optimizer, train_loader, epoch)
        scheduler.step()
        acc = evaluate(model, test_loader)
        print(f"epoch {epoch} loss {loss:.4f} acc {acc:.4f}")


if __name__ == "__main__":
    main()
