"""Image classification: a CNN on scikit-learn's handwritten digits, upscaled
from 8x8 to --size (32) pixels.  A plain training script (it does not import
flor).  --device cuda trains on the GPU (benchmarks/gpu_record.py).

    python image_cnn.py --epochs 8 [--save-dir DIR]   # DIR: torch.save every epoch
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--limit", type=int, default=1797)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--size", type=int, default=32, help="image side, a multiple of 8")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X[:args.limit], dtype=torch.float32).view(-1, 1, 8, 8) / 16
    X = F.interpolate(X, size=args.size, mode="bilinear", align_corners=False)
    y = torch.tensor(y[:args.limit])
    n_val = len(X) // 5
    train = torch.utils.data.TensorDataset(X[n_val:], y[n_val:])
    loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True)
    w = args.width
    model = nn.Sequential(
        nn.Conv2d(1, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.25), nn.Linear(4 * w * (args.size // 8) ** 2, 128), nn.ReLU(),
        nn.Linear(128, 10)).to(args.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for xb, yb in loader:
            xb, yb = xb.to(args.device), yb.to(args.device)
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item()
        sched.step()
        model.eval()
        with torch.no_grad():
            acc = (model(X[:n_val].to(args.device)).argmax(1)
                   == y[:n_val].to(args.device)).float().mean().item()
        print(f"epoch {epoch} train_loss {total / len(loader):.4f} val_acc {acc:.4f}")
        if args.save_dir:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.save_dir, f"epoch{epoch}.pt"))


if __name__ == "__main__":
    main()
