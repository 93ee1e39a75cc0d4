"""An ensemble trained with its optimizers stepped in comprehensions
(`[o.step() for o in opts]`), as short scripts write it."""
import torch
import torch.nn as nn

torch.set_num_threads(1)
torch.manual_seed(0)
models = [nn.Linear(4, 1), nn.Linear(4, 1)]
opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
X = torch.randn(64, 4)
Y = X.sum(1, keepdim=True)
for epoch in range(4):
    for i in range(0, 64, 16):
        [o.zero_grad() for o in opts]
        loss = sum(((m(X[i:i + 16]) - Y[i:i + 16]) ** 2).mean() for m in models)
        loss.backward()
        [o.step() for o in opts]
    print(f"epoch {epoch} loss {loss.item():.6f}")
