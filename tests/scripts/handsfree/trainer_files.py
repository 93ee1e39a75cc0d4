"""A trainer in the style of the PyTorch examples that writes its metrics
to files from its batch loop, as many projects do, and reads them back
after each epoch: losses to a text file and a binary file held open, a CSV
through csv.writer, a log file through logging, a step log opened for
appending at every step (truncated at the start, as small GPT trainers do)
and a status file rewritten at every step through pathlib."""
import argparse
import csv
import json
import logging
import os
import pathlib
import struct

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

log = logging.getLogger("train")


def train(args, model, optimizer, X, y, epoch, files):
    losses, raw, metrics = files
    model.train()
    for step, i in enumerate(range(0, len(y), args.batch_size)):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(X[i:i + args.batch_size]), y[i:i + args.batch_size])
        loss.backward()
        optimizer.step()
        value = loss.item()
        losses.write(f"{value:.6f}\n")
        raw.write(struct.pack("<d", value))
        metrics.writerow([epoch, step, f"{value:.6f}"])
        log.info("epoch %d step %d loss %.6f", epoch, step, value)
        with open(os.path.join(args.out, "steps.log"), "a") as f:
            f.write(f"{epoch} {step} train {value:.6f}\n")
        pathlib.Path(args.out, "status.json").write_text(json.dumps({"epoch": epoch,
                                                                    "step": step}))


def seen(out):
    """What the files hold so far."""
    with open(os.path.join(out, "losses.txt")) as f:
        text = [float(line) for line in f]
    with open(os.path.join(out, "losses.bin"), "rb") as f:
        raw = f.read()
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
        rows = list(csv.reader(f))
    with open(os.path.join(out, "steps.log")) as f:
        steps = f.read().splitlines()
    status = json.loads(pathlib.Path(out, "status.json").read_text())
    return text, len(raw) // 8, len(rows) - 1, len(steps), status


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    logging.basicConfig(filename="train.log", filemode="w", level=logging.INFO,
                        format="%(name)s %(message)s")
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "steps.log"), "w").close()
    digits = load_digits()
    X = torch.tensor(digits.data[:1024], dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target[:1024])
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = open(os.path.join(args.out, "losses.txt"), "w")
    raw = open(os.path.join(args.out, "losses.bin"), "wb")
    metrics_file = open(os.path.join(args.out, "metrics.csv"), "w", newline="")
    metrics = csv.writer(metrics_file)
    metrics.writerow(["epoch", "step", "loss"])
    for epoch in range(args.epochs):
        train(args, model, optimizer, X, y, epoch, (losses, raw, metrics))
        for f in (losses, raw, metrics_file):
            f.flush()
        text, nraw, rows, steps, status = seen(args.out)
        print(f"epoch {epoch}: {len(text)} losses (mean {sum(text) / len(text):.6f}), "
              f"{nraw} raw, {rows} rows, {steps} steps, status {status}")


if __name__ == "__main__":
    main()
