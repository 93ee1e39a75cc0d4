import torch
import torch.nn as nn

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X, Y = torch.randn(32, 4), torch.randn(32, 1)
best = None
snaps = []
for epoch in range(6):
    for i in range(0, 32, 8):
        opt.zero_grad()
        ((model(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean().backward()
        opt.step()
    if epoch == 1:
        best = model.state_dict()  # no copy: follows the weights
        snaps.append(model.weight.data)
    print(f"epoch {epoch}")
print("final", model.weight.sum().item(), best["weight"].sum().item(),
      [s.sum().item() for s in snaps])
