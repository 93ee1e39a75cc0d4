"""Train a small CNN on scikit-learn's bundled handwritten digits, with flor.

The digits (1797 8x8 images) ship inside scikit-learn: nothing is downloaded.
They are upscaled to 16x16; with the default width an epoch takes about two
seconds on one core.

    python examples/train_digits.py --epochs 20            # records (the default)
    python -m flor record examples/train_digits.py         # the same, explicitly
    python -m flor replay examples/train_digits.py         # after adding log statements
"""
import argparse
import gzip
import importlib.util
import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flor


def digits_file():
    """scikit-learn's bundled copy of the UCI handwritten digits, found without
    importing scikit-learn (which would add a second to every process)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise SystemExit("this example reads the digits that ship with scikit-learn: "
                         "pip install scikit-learn")
    return os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


class Net(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25),
                                  nn.Linear(2 * width * 16, 128), nn.ReLU(),
                                  nn.Dropout(0.25), nn.Linear(128, 10))

    def forward(self, x):
        return self.head(self.features(x))


def load_data(limit=None):
    with gzip.open(digits_file(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)  # 1797 rows: 64 pixels, label
    x = torch.from_numpy(table[:, :64]).reshape(-1, 1, 8, 8) / 16.0
    x = nn.functional.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
    y = torch.from_numpy(table[:, 64]).long()
    if limit:
        x, y = x[:limit], y[:limit]
    split = int(0.9 * len(y))
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


@torch.no_grad()
def evaluate(model, data, batch_size=256):
    model.eval()
    x, y = data.tensors
    logits = torch.cat([model(x[i:i + batch_size]) for i in range(0, len(y), batch_size)])
    return nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="use only this many images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; replay matches values bit for bit "
                             "only with the thread count of the record")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, test = load_data(args.limit)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    model = Net(args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=2)
    print(f"training on {len(train)} images, testing on {len(test)}")

    for epoch in flor.generator(range(args.epochs)):
        if flor.SkipBlock.step_into("train"):
            model.train()
            for x, y in loader:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
        model, optimizer = flor.SkipBlock.end(model, optimizer)
        scheduler.step()
        val_loss, val_acc = evaluate(model, test)
        plateau.step(val_loss)
        flor.log("val_loss", val_loss)
        flor.log("val_acc", val_acc)
        print(f"epoch {epoch}: val_loss {val_loss:.4f} val_acc {val_acc:.4f} "
              f"lr {optimizer.param_groups[0]['lr']:.2e}")

    print(f"final test accuracy {evaluate(model, test)[1]:.4f}")


if __name__ == "__main__":
    main()
