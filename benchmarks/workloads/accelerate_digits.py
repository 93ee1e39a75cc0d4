"""An Accelerate training script in the shape of Accelerate's own examples
(nlp_example.py, cv_example.py): a function that builds the Accelerator,
prepares model, optimizer, data loaders and scheduler, and trains epochs
with accumulate(), backward() and gather_for_metrics(); sklearn's digits."""
import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


def get_dataloaders(batch_size):
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    train = TensorDataset(x[:1400], y[:1400])
    valid = TensorDataset(x[1400:], y[1400:])
    return (DataLoader(train, batch_size=batch_size, shuffle=True),
            DataLoader(valid, batch_size=64))


class Net(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, width)
        self.fc2 = torch.nn.Linear(width, 10)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def training_function(args):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    set_seed(42)
    train_dl, eval_dl = get_dataloaders(args.batch_size)
    model = Net(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_dl))
    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, lr_scheduler)
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for step, (x, y) in enumerate(train_dl):
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            total += loss.item()
        model.eval()
        correct = n = 0
        for x, y in eval_dl:
            with torch.no_grad():
                pred = model(x).argmax(dim=-1)
            pred, ref = accelerator.gather_for_metrics((pred, y))
            correct += (pred == ref).sum().item()
            n += ref.numel()
        accelerator.print(f"epoch {epoch}: loss {total / len(train_dl):.5f} acc {correct / n:.4f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--accumulate", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    training_function(args)


if __name__ == "__main__":
    main()
