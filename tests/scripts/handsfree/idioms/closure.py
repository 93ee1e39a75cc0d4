import torch
torch.set_num_threads(1)
torch.manual_seed(0)

def main():
    X = torch.randn(64, 4); Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run_epoch():
        total = 0.0
        for i in range(0, 64, 16):
            opt.zero_grad()
            loss = ((model(X[i:i+16]) - Y[i:i+16]) ** 2).mean()
            loss.backward()
            opt.step()
            total += loss.item()
        return total

    for epoch in range(4):
        total = run_epoch()
        print(f"epoch {epoch} loss {total:.5f}")

main()
