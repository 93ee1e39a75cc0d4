"""A small classifier whose inner loop loads samples through CountingDataset."""
import torch
from torch.utils.data import DataLoader

import flor
from counting import CountingDataset

torch.set_num_threads(1)
torch.manual_seed(0)
loader = DataLoader(CountingDataset(64), batch_size=16, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in flor.generator(range(3)):
    if flor.SkipBlock.step_into("train"):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    model, opt = flor.SkipBlock.end(model, opt)
    flor.log("w", model[0].weight.sum())
    print("epoch", epoch, round(float(model[0].weight.sum()), 6))
