import types

import torch

torch.set_num_threads(1)
torch.manual_seed(0)

CFG = types.SimpleNamespace(lr=0.05, examples=0)
STATS = {"batches": 0}
PARITY = {"even": 0, "odd": 0}


class Meter:
    updates = 0  # a class attribute every instance reads
    resets = 0

    @classmethod
    def reset(cls):
        cls.resets += 1


def train_step(model, opt, x, y):
    Meter.updates += 1
    CFG.examples += len(x)
    s = STATS  # changed through a local alias
    s["batches"] += 1
    parity = PARITY  # an item by a variable key
    parity["even" if Meter.updates % 2 == 0 else "odd"] += 1
    if Meter.updates % 3 == 0:
        Meter.reset()
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.item()


model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=CFG.lr)
X = torch.randn(64, 4)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
for epoch in range(4):
    total = 0.0
    for i in range(0, 64, 16):
        total += train_step(model, opt, X[i:i + 16], Y[i:i + 16])
    print(f"epoch {epoch} loss {total:.5f}")
print("done", model.weight.sum().item())
