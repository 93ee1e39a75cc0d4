import random

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
random.seed(0)
torch.manual_seed(0)
X = torch.randn(320, 12)
Y = (X[:, :3].sum(1) > 0).long()
order = list(range(len(X)))
model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.Adam(model.parameters(), lr=2e-3)


def train_epoch(model, opt, order):
    random.shuffle(order)
    total = 0.0
    for i in range(0, len(order), 64):
        idx = torch.tensor(order[i:i + 64])
        opt.zero_grad()
        loss = F.cross_entropy(model(X[idx]), Y[idx])
        loss.backward()
        opt.step()
        total += loss.item()
    return total


for epoch in range(6):
    total = train_epoch(model, opt, order)
    print(f"epoch {epoch} loss {total:.6f} first {order[:3]}")
