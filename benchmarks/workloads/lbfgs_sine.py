"""The shape of pytorch/examples' time_sequence_prediction/train.py: an
LSTM learns sine waves, optimised by LBFGS with a closure, one optimizer
step per loop iteration (the training step is inline: no nested loop),
then a prediction that continues the waves.  The waves are computed (as
that example's generate_sine_wave.py does); nothing is downloaded.  A plain
training script (it does not import flor).

    python lbfgs_sine.py --steps 8
"""
import argparse

import numpy as np
import torch
import torch.nn as nn


class Sequence(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input, future=0):
        outputs = []
        n = input.size(0)
        h_t = torch.zeros(n, self.hidden, dtype=torch.double)
        c_t = torch.zeros(n, self.hidden, dtype=torch.double)
        h_t2 = torch.zeros(n, self.hidden, dtype=torch.double)
        c_t2 = torch.zeros(n, self.hidden, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


def sine_waves(n, length, period):
    rng = np.random.RandomState(2)
    x = np.arange(length) + rng.randint(-4 * period, 4 * period, n).reshape(n, 1)
    return np.sin(x / period).astype("float64")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--waves", type=int, default=40)
    p.add_argument("--length", type=int, default=300)
    p.add_argument("--hidden", type=int, default=32)
    args = p.parse_args()
    np.random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = sine_waves(args.waves, args.length, 20)
    input = torch.from_numpy(data[3:, :-1])
    target = torch.from_numpy(data[3:, 1:])
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    seq = Sequence(args.hidden).double()
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8)
    for i in range(args.steps):
        print("STEP:", i)

        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            print("loss:", f"{loss.item():.6f}")
            loss.backward()
            return loss

        optimizer.step(closure)
        with torch.no_grad():
            future = 100
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            print("test loss:", f"{loss.item():.6f}")


if __name__ == "__main__":
    main()
