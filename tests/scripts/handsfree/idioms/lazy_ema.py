"""An EMA copy of the model made lazily, in the first training step
(`if ema is None: ema = copy.deepcopy(model)`), then averaged in place."""
import copy

import torch
import torch.nn as nn

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
X, Y = torch.randn(64, 4), torch.randn(64, 1)
ema = None
for epoch in range(4):
    for i in range(0, 64, 16):
        opt.zero_grad()
        loss = ((model(X[i:i + 16]) - Y[i:i + 16]) ** 2).mean()
        loss.backward()
        opt.step()
        if ema is None:
            ema = copy.deepcopy(model)
        else:
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters()):
                    pe.mul_(0.5).add_(p, alpha=0.5)
    with torch.no_grad():
        print(f"epoch {epoch} loss {loss.item():.6f} ema {((ema(X) - Y) ** 2).mean().item():.6f}")
