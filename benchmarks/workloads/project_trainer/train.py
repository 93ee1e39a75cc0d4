"""A project whose training loop lives in its own library module, not in
the script: a class-based Trainer (mylib/trainer.py) with fit(),
train_epoch() and evaluate(), the model in mylib/model.py, the data in
mylib/data.py (scikit-learn's bundled digits, upscaled: nothing is
downloaded), and the script wiring them up with argparse and a callback.

    python train.py --epochs 4
"""
import argparse

import torch

from mylib import Trainer
from mylib.data import digits
from mylib.model import Net


def report(trainer):
    if trainer.epoch % 5 == 4:
        print(f"  best accuracy so far {max(trainer.accuracies):.4f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--limit", type=int, default=1797)
    args = parser.parse_args()
    torch.manual_seed(1)
    train, test = digits(args.limit)
    model = Net(args.width)
    trainer = Trainer(model, train, test, lr=1.0, callbacks=[report])
    trainer.fit(args.epochs)
    print(f"final accuracy {trainer.accuracies[-1]:.4f}")


if __name__ == "__main__":
    main()
