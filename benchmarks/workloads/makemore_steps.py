"""The shape of makemore's training loop: a `while True` step loop with the
training step inline (no nested loop), a random batch drawn at each step, a
line printed every few steps, an evaluation at the end.  The words are the
names of Python's keywords and builtins and of the standard library's
modules (nothing is downloaded).  A plain training script (it does not
import flor).

    python makemore_steps.py --max-steps 3000
"""
import argparse
import builtins
import keyword
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def words():
    names = set(keyword.kwlist) | set(dir(builtins)) | set(sys.stdlib_module_names)
    return sorted(w.lower() for w in names if w.isidentifier() and not w.startswith("_"))


def dataset(ws, stoi, block_size):
    X, Y = [], []
    for w in ws:
        context = [0] * block_size
        for ch in w + ".":
            ix = stoi[ch]
            X.append(context)
            Y.append(ix)
            context = context[1:] + [ix]
    return torch.tensor(X), torch.tensor(Y)


class MLP(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd, n_hidden):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.mlp = nn.Sequential(nn.Linear(block_size * n_embd, n_hidden), nn.Tanh(),
                                 nn.Linear(n_hidden, vocab_size))

    def forward(self, idx, targets=None):
        logits = self.mlp(self.wte(idx).flatten(1))
        loss = None if targets is None else F.cross_entropy(logits, targets)
        return logits, loss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=24)
    p.add_argument("--n-hidden", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=3407)
    p.add_argument("--loop-seconds", action="store_true",
                   help="say on stderr how long the training loop took (for benchmarks)")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    ws = words()
    chars = sorted(set("".join(ws)))
    stoi = {ch: i + 1 for i, ch in enumerate(chars)}
    stoi["."] = 0
    n = int(0.9 * len(ws))
    Xtr, Ytr = dataset(ws[:n], stoi, args.block_size)
    Xte, Yte = dataset(ws[n:], stoi, args.block_size)
    model = MLP(len(stoi), args.block_size, args.n_embd, args.n_hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate,
                                  weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8)
    step = 0
    t0 = time.perf_counter()
    while True:
        ix = torch.randint(0, Xtr.shape[0], (args.batch_size,))
        logits, loss = model(Xtr[ix], Ytr[ix])
        model.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            print(f"step {step} | loss {loss.item():.4f}")
        step += 1
        if step >= args.max_steps:
            break
    if args.loop_seconds:
        print(f"loop seconds: {time.perf_counter() - t0:.6f}", file=sys.stderr)
    with torch.no_grad():
        _, test_loss = model(Xte, Yte)
    print(f"test loss {test_loss.item():.4f}")


if __name__ == "__main__":
    main()
