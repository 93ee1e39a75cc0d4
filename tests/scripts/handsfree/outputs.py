"""A trainer that keeps its outputs in files, as many do: its arguments
dumped to JSON and read back, metadata saved atomically (a temporary file,
then os.replace), a model config written and read back through one "w+"
file, a log file through logging.basicConfig, and a metrics
CSV written through csv.writer on a file opened before the loop."""
import argparse
import csv
import json
import logging
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    json.dump(vars(args), open(os.path.join(args.out, "args.json"), "w"))
    args = argparse.Namespace(**json.load(open(os.path.join(args.out, "args.json"))))
    tmp = os.path.join(args.out, "meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"data": "digits", "classes": 10}, f)
    os.replace(tmp, os.path.join(args.out, "meta.json"))
    with open(os.path.join(args.out, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(args.out, "model.json"), "w+") as f:
        json.dump({"hidden": 32}, f)
        f.seek(0)
        hidden = json.load(f)["hidden"]
    logging.basicConfig(filename=os.path.join(args.out, "train.log"), filemode="w",
                        level=logging.INFO, format="%(message)s")
    torch.manual_seed(1)
    torch.set_num_threads(1)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X[:480], dtype=torch.float32) / 16
    y = torch.tensor(y[:480])
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, meta["classes"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    metrics = open(os.path.join(args.out, "metrics.csv"), "w", newline="")
    writer = csv.writer(metrics)
    writer.writerow(["epoch", "loss", "acc"])
    for epoch in range(args.epochs):
        model.train()
        for i in range(0, len(X), 32):
            opt.zero_grad()
            loss = F.cross_entropy(model(X[i:i + 32]), y[i:i + 32])
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = (model(X).argmax(1) == y).float().mean().item()
        writer.writerow([epoch, f"{loss.item():.6f}", f"{acc:.6f}"])
        metrics.flush()
        logging.info("epoch %d acc %.6f", epoch, acc)
        print(f"epoch {epoch} acc {acc:.6f} on {meta['data']}")
    metrics.close()


if __name__ == "__main__":
    main()
