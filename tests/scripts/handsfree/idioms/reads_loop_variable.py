import copy
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.set_num_threads(1)
torch.manual_seed(0)
device = torch.device("cpu")
X = torch.randn(64, 4); Y = (X.sum(1, keepdim=True) > 0).float()
loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(device)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
loss_fn = torch.nn.BCEWithLogitsLoss()
best_acc, best_state = -1.0, None
losses = []
step = 0
for epoch in range(5):
    model.train()
    total = 0.0
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        total += loss.item()
        step += 1
    sched.step()
    losses.append(total)
    model.eval()
    with torch.no_grad():
        acc = ((model(X) > 0).float() == Y).float().mean().item()
    if acc > best_acc:
        best_acc = acc
        best_state = copy.deepcopy(model.state_dict())
    print(f"epoch {epoch} total {total:.6f} acc {acc:.4f} step {step} lr {sched.get_last_lr()[0]}")
print("best", best_acc, len(losses), sum(losses))
model.load_state_dict(best_state)
print("final", model[0].weight.sum().item())
