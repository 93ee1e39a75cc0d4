"""A `while` loop in flor's documented form: an unbounded generator and a break."""
import itertools

import torch

import flor

torch.manual_seed(0)
x = torch.ones(3)
steps = 0
for _ in flor.generator(itertools.count()):
    if flor.SkipBlock.step_into("work"):
        x = x * 1.5 + torch.rand(3)
    x = flor.SkipBlock.end(x)
    steps += 1
    flor.log("x", x.sum())
    if x.sum() > 100:
        break
print("steps", steps, round(float(x.sum()), 4))
