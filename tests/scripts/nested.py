"""Nested SkipBlocks, one unnamed, with every random-number generator in use."""
import random

import numpy as np
import torch

import flor

torch.set_num_threads(1)
torch.manual_seed(0)
np.random.seed(0)
random.seed(0)
w = torch.zeros(4)
stats = {"calls": 0}
history = []

for epoch in flor.generator(range(5)):
    if flor.SkipBlock.step_into("outer"):
        if flor.SkipBlock.step_into("inner"):
            for i in range(3):
                w += torch.randn(4) * 0.1
        w = flor.SkipBlock.end(w)
        if flor.SkipBlock.step_into():
            for i in range(2):
                stats["calls"] += 1
                history.append(float(np.random.rand()))
        stats, history = flor.SkipBlock.end(stats, history)
    w, stats, history = flor.SkipBlock.end(w, stats, history)
    flor.log("w", w.sum())
    flor.log("after", random.random() + float(torch.rand(1)) + float(np.random.rand()))
    flor.log("calls", stats["calls"])
    print(epoch, round(float(w.sum()), 6), stats["calls"], len(history))
print("done", round(sum(history), 6))
