"""A SkipBlock that draws from generators of its own and passes them to
end(): numpy's RandomState and Generator(MT19937) (their state holds an
array), a torch.Generator and a random.Random."""
import random

import numpy as np
import torch

import flor

torch.set_num_threads(1)
rs = np.random.RandomState(7)
mt = np.random.Generator(np.random.MT19937(8))
pcg = np.random.default_rng(9)
tg = torch.Generator().manual_seed(10)
rr = random.Random(11)
w = torch.zeros(3)

for epoch in flor.generator(range(4)):
    if flor.SkipBlock.step_into("draws"):
        for i in range(5):
            w += torch.randn(3, generator=tg) * float(rs.rand()) * float(mt.random())
            w -= float(pcg.random()) * rr.random()
    w, rs, mt, pcg, tg, rr = flor.SkipBlock.end(w, rs, mt, pcg, tg, rr)
    print(epoch, round(float(w.sum()), 6), round(float(rs.rand()), 6), round(float(mt.random()), 6),
          round(float(pcg.random()), 6), round(float(torch.rand(1, generator=tg)), 6),
          round(rr.random(), 6))
