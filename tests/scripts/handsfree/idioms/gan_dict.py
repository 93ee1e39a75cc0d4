"""A GAN kept in dicts, as many GAN scripts keep it: models, optimizers
and schedulers by name, `for m in models.values(): m.train()` at each
epoch's start, an evaluation that leaves them in eval mode, and a model
whose forward counts its calls (a counter no state dict holds)."""
import torch
import torch.nn as nn


class Counted(nn.Sequential):
    def __init__(self, *layers):
        super().__init__(*layers)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def evaluate(models, z):
    for m in models.values():
        m.eval()
    with torch.no_grad():
        return models["D"](models["G"](z)).mean().item()


torch.manual_seed(0)
models = {"G": Counted(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 8)),
          "D": Counted(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Dropout(0.3), nn.Linear(16, 1))}
opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.5, 0.999))
        for k, m in models.items()}
scheds = {k: torch.optim.lr_scheduler.ExponentialLR(o, 0.9) for k, o in opts.items()}
real = torch.randn(128, 8) * 0.5 + 1.0
bce = nn.BCEWithLogitsLoss()
for epoch in range(4):
    for m in models.values():
        m.train()
    for i in range(0, 128, 32):
        z = torch.randn(32, 4)
        opts["D"].zero_grad()
        fake = models["G"](z)
        ld = bce(models["D"](real[i:i + 32]), torch.ones(32, 1)) + \
            bce(models["D"](fake.detach()), torch.zeros(32, 1))
        ld.backward()
        opts["D"].step()
        opts["G"].zero_grad()
        lg = bce(models["D"](fake), torch.ones(32, 1))
        lg.backward()
        opts["G"].step()
    for s in scheds.values():
        s.step()
    score = evaluate(models, torch.randn(16, 4))
    print(f"epoch {epoch} ld {ld.item():.6f} lg {lg.item():.6f} score {score:.6f} "
          f"calls {models['G'].calls} {models['D'].calls}")
