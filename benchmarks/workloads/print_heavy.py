"""A training loop that prints a short line at every step, as scripts that
log with print() do: a linear model fitted by SGD, one line per step, on a
fixed synthetic data set.  Printing dominates its time.  A plain training
script (it does not import flor).

    python print_heavy.py --epochs 20 --steps 5000     # 100,000 lines
"""
import argparse
import random


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--steps", type=int, default=5000)
    args = p.parse_args()
    rng = random.Random(0)
    data = [(x, 2.0 * x - 1.0 + rng.gauss(0, 0.1)) for x in (rng.uniform(-1, 1)
                                                                for _ in range(1000))]
    w, b, lr = 0.0, 0.0, 0.1
    for epoch in range(args.epochs):
        total = 0.0
        for step in range(args.steps):
            x, y = data[step % len(data)]
            err = w * x + b - y
            w -= lr * err * x
            b -= lr * err
            total += err * err
            print(f"epoch {epoch} step {step} loss {err * err:.5f}")
        lr *= 0.9
        print(f"epoch {epoch} mean loss {total / args.steps:.6f} w {w:.4f} b {b:.4f}")


if __name__ == "__main__":
    main()
