import torch
torch.set_num_threads(1)
torch.manual_seed(0)
history = []
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(16, 4); Y = torch.randn(16, 1)

def main():
    for epoch in range(4):
        for i in range(4):
            x, y = X[i*4:(i+1)*4], Y[i*4:(i+1)*4]
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            history.append(loss.item())
        print("epoch", epoch, len(history), model.weight.sum().item())

main()
