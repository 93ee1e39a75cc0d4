import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
torch.manual_seed(0)
X = torch.randn(256, 10)
Y = (X[:, 0] + X[:, 1] > 0).long()
model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for epoch in range(6):
    for i in range(0, 256, 32):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(X[i:i + 32]), Y[i:i + 32])
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch} loss {loss.item():.6f}")
