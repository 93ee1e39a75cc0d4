"""StepLR stepped per epoch, a shuffling DataLoader and dropout."""
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

torch.manual_seed(4)
torch.set_num_threads(1)
X, y = load_digits(return_X_y=True)
X = torch.tensor(X[:320], dtype=torch.float32) / 16
y = torch.tensor(y[:320])
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=32,
                                     shuffle=True)
net = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                          torch.nn.Linear(48, 10))
opt = torch.optim.SGD(net.parameters(), lr=0.2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
for epoch in range(3):
    net.train()
    total = 0.0
    for xb, yb in loader:
        opt.zero_grad()
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        total += loss.item()
    sched.step()
    net.eval()
    with torch.no_grad():
        acc = (net(X).argmax(1) == y).float().mean().item()
    print(f"epoch {epoch} loss {total:.6f} acc {acc:.6f} lr {sched.get_last_lr()[0]:.6f} "
          f"noise {torch.rand(1).item():.6f}")
