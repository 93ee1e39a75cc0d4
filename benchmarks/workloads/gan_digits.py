"""The shape of pytorch/examples' dcgan/main.py: a generator and a
discriminator, each with its own Adam optimizer, updated in turn over the
batches of every epoch, with a line printed every few batches.  Digits from
scikit-learn's bundled copy (nothing is downloaded).  A plain training
script (it does not import flor).

    python gan_digits.py --epochs 10
"""
import argparse
import gzip
import importlib.util
import os

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def digits():
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return TensorDataset(torch.from_numpy(table[:, :64]) / 8.0 - 1.0)


class Generator(nn.Module):
    def __init__(self, nz, ngf):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, ngf), nn.BatchNorm1d(ngf), nn.ReLU(True),
                                  nn.Linear(ngf, 2 * ngf), nn.BatchNorm1d(2 * ngf), nn.ReLU(True),
                                  nn.Linear(2 * ngf, 64), nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(64, 2 * ndf), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Linear(2 * ndf, ndf), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Linear(ndf, 1), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--nz", type=int, default=32)
    p.add_argument("--ngf", type=int, default=256)
    p.add_argument("--ndf", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=999)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    loader = DataLoader(digits(), batch_size=args.batch_size, shuffle=True, drop_last=True)
    netG, netD = Generator(args.nz, args.ngf), Discriminator(args.ndf)
    criterion = nn.BCELoss()
    fixed_noise = torch.randn(64, args.nz)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(0.5, 0.999))
    for epoch in range(args.epochs):
        for i, (real,) in enumerate(loader):
            # (1) the discriminator: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            label = torch.full((real.size(0),), 1.0)
            output = netD(real)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()
            fake = netG(torch.randn(real.size(0), args.nz))
            label.fill_(0.0)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()
            # (2) the generator: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(1.0)
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()
            if i % 20 == 0:
                print(f"[{epoch}/{args.epochs}][{i}/{len(loader)}] Loss_D: {errD.item():.4f} "
                      f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f} "
                      f"D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}")
        with torch.no_grad():
            sample = netG(fixed_noise)
        print(f"epoch {epoch} sample mean {sample.mean().item():.4f} std {sample.std().item():.4f}")


if __name__ == "__main__":
    main()
