"""A step loop with Accelerate's gradient accumulation: backward() every
iteration, the optimizer acting every fourth (accumulate() decides), so the
gradients one iteration leaves are read by the next; sklearn's digits."""
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)
torch.manual_seed(0)
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
d = load_digits()
x = torch.tensor(d.data, dtype=torch.float32) / 16.0
y = torch.tensor(d.target)
train_dl = DataLoader(TensorDataset(x[:480], y[:480]), batch_size=16, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
losses = []
for it, (xb, yb) in enumerate(train_dl):
    with accelerator.accumulate(model):
        loss = F.cross_entropy(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss.item())
    if it % 5 == 0:
        print(it, round(sum(losses[-5:]) / len(losses[-5:]), 6))
print("final", sum(losses) / len(losses))
