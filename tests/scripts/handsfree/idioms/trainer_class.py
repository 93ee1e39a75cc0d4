import torch
torch.set_num_threads(1)
torch.manual_seed(0)

class Trainer:
    def __init__(self):
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.X = torch.randn(64, 4)
        self.Y = self.X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        self.steps = 0
        self.log = []

    def train_step(self, x, y):
        self.opt.zero_grad()
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        self.opt.step()
        self.steps += 1
        return loss.item()

    def fit(self, epochs):
        for epoch in range(epochs):
            total = 0.0
            for i in range(0, 64, 16):
                total += self.train_step(self.X[i:i+16], self.Y[i:i+16])
            self.log.append(total)
            print(f"epoch {epoch} loss {total:.5f} steps {self.steps}")

t = Trainer()
t.fit(4)
print("done", t.steps, len(t.log), t.model.weight.sum().item())
