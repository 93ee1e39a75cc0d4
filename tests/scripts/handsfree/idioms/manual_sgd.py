import torch
torch.set_num_threads(1)
torch.manual_seed(0)
X = torch.randn(64, 4); Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
model = torch.nn.Linear(4, 1)
lr = 0.05
for epoch in range(4):
    total = 0.0
    for i in range(0, 64, 16):
        loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
        total += loss.item()
    print(f"epoch {epoch} loss {total:.5f}")
