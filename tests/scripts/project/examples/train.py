import torch
from sklearn.datasets import load_digits

from mylib.trainer import Trainer


def report(trainer):
    trainer.reports = getattr(trainer, "reports", 0) + 1
    print(f"  epoch {trainer.epoch} took {trainer.epoch_time * 1000:.1f} ms")


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32) / 16
    y = torch.tensor(y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(model, opt, (X, y), callbacks=[report])
    history = trainer.fit(6)
    print("final", round(history[-1], 5))


if __name__ == "__main__":
    main()
