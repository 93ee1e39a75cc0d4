"""Training-loop shapes that gave wrong values in parallel replay, as small
scripts: tests/test_boundaries.py checks what flor says of each, and
tests/test_exactness.py replays each at every segment boundary."""

HEADER_REBOUND = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(12)]
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    score = 0
    for b, (x, y) in enumerate(data):
        x = x * 2.0
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        correct = int((model(x).argmax(-1) == y).sum())
        score += correct
    print("score", score)
"""

TRAINER = """
    class Trainer:
        def __init__(self, callbacks):
            self.callbacks = callbacks

        def fit(self, model, epochs):
            for epoch in range(epochs):
                for cb in self.callbacks:
                    cb.on_epoch(self, model, epoch)
"""

CALLBACK = """
    import torch
    from mylib import Trainer
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = [(torch.randn(16, 4), torch.randint(0, 2, (16,))) for _ in range(20)]
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)


    def train_epoch(model, opt, data):
        correct = 0
        for x, y in data:
            for _ in range(2):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            correct += int((model(x).argmax(-1) == y).sum())
        return correct


    class Printer:
        def on_epoch(self, trainer, model, epoch):
            print("epoch", epoch, "correct", train_epoch(model, opt, data))


    Trainer([Printer()]).fit(model, 3)
"""

INFINITE_LOADER = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    class InfiniteDataLoader:
        def __init__(self, dataset, **kwargs):
            sampler = torch.utils.data.RandomSampler(dataset, replacement=True,
                                                     num_samples=int(1e10))
            self.train_loader = DataLoader(dataset, sampler=sampler, **kwargs)
            self.data_iter = iter(self.train_loader)

        def next(self):
            try:
                batch = next(self.data_iter)
            except StopIteration:
                self.data_iter = iter(self.train_loader)
                batch = next(self.data_iter)
            return batch


    torch.manual_seed(0)
    torch.set_num_threads(1)
    X = torch.randn(256, 8)
    Y = (X.sum(1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch_loader = InfiniteDataLoader(TensorDataset(X, Y), batch_size=16, num_workers=2)


    def evaluate(model):
        total = 0.0
        for x, y in DataLoader(TensorDataset(X, Y), batch_size=64):
            total += torch.nn.functional.cross_entropy(model(x), y).item()
        return round(total, 4)


    step = 0
    while True:
        x, y = batch_loader.next()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            print(f"step {step} | loss {loss.item():.4f}")
        if step % 20 == 0:
            val = evaluate(model)
            print("eval", val)
        step += 1
        if step >= 60:
            break
"""

ITERATOR_IN_BLOCK = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(100)]
    train_iter = iter(data)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(4):
        for step in range(10):
            x, y = next(train_iter)
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
        print("epoch", epoch, round(loss.item(), 6))
"""

TUPLE_TARGETS = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    xs = [torch.randn(8, 4) for _ in range(5)]
    ys = [torch.randn(8, 1) for _ in range(5)]
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i, (x, y) in enumerate(zip(xs, ys)):
        for _ in range(3):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        x = x + 1
        print(i, round(model(x).sum().item(), 6))
"""

WHILE_REBINDS_ITS_CONDITION = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, Y = torch.randn(32, 4), torch.randn(32, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step, lr = 0, 0.1
    while step < 5 and lr > 1e-3:
        for i in range(0, 32, 8):
            opt.zero_grad()
            ((model(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean().backward()
            opt.step()
        lr = lr * 0.5
        for g in opt.param_groups:
            g["lr"] = lr
        step += 1
        print(step, lr, round(model.weight.sum().item(), 6))
"""

# A generator of random batches, the model and its optimizer (shapes below).
_BATCHES = """    torch.set_num_threads(1)


    def batches(n):
        g = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = batches(8)
"""

GENERATOR_LOADER = """
    import torch
    torch.manual_seed(0)
""" + _BATCHES + """    for epoch in range(5):
        for _ in range(3):
            x, y = next(gen)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        print(epoch, round(model.weight.sum().item(), 6))
"""

LOOP_VARIABLE_AFTER = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, Y = torch.randn(32, 4), torch.randn(32, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(5):
        for i in range(0, 32, 8):
            opt.zero_grad()
            loss = ((model(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean()
            loss.backward()
            opt.step()
        print(epoch, round(loss.item(), 6))
    print("last", epoch, i, round(model.weight.sum().item(), 6))
"""

READ_BY_A_FUNCTION = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, Y = torch.randn(32, 4), torch.randn(32, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    history = []
    last = 0.0


    def report(epoch):
        history.append(round(last, 6))
        print("report", epoch, history[-1], len(history))


    for epoch in range(5):
        report(epoch)
        for i in range(0, 32, 8):
            opt.zero_grad()
            loss = ((model(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean()
            loss.backward()
            opt.step()
        last = loss.item()
"""

SOMETIMES_ASSIGNED = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, Y = torch.randn(32, 4), torch.randn(32, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    best, best_epoch, snap = float("inf"), -1, None
    for epoch in range(5):
        for i in range(0, 32, 8):
            opt.zero_grad()
            loss = ((model(X[i:i + 8]) - Y[i:i + 8]) ** 2).mean()
            loss.backward()
            opt.step()
        val = round(loss.item(), 6)
        if val < best:
            best = val
            best_epoch = epoch
        if epoch % 2 == 0 and (snap := val):
            pass
        print(epoch, val, snap)
    print("best", best, "at", best_epoch)
"""

ITERATOR_EACH_EPOCH = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, Y = torch.randn(64, 4), torch.randn(64, 1)
    loader = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
    batches = enumerate(DataLoader(TensorDataset(X, Y), batch_size=8))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(5):
        it = iter(loader)
        for _ in range(len(loader)):
            x, y = next(it)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        k, (x, y) = next(batches)
        print(epoch, k, round(((model(x) - y) ** 2).mean().item(), 6))
"""

# Each epoch's training loop takes the next three batches of one generator
# (itertools.islice), and an evaluation draws with `for ... break` from a
# DataLoader iterator kept across epochs: the blocks advance both.
SLICED_GENERATOR = """
    import itertools
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
""" + _BATCHES + """    held_out = iter(DataLoader(TensorDataset(torch.randn(40, 4), torch.randn(40, 1)),
                               batch_size=8))
    for epoch in range(5):
        for x, y in itertools.islice(gen, 3):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        for x, y in held_out:
            break
        print(epoch, round(((model(x) - y) ** 2).mean().item(), 6))
"""

# The same training loop over a list of batches made before it: a list is
# iterated afresh by each epoch, and its blocks are checkpointed.
LIST_OF_BATCHES = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(5):
        for x, y in data:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        print(epoch, round(model.weight.sum().item(), 6))
"""

# The main loop draws its epochs from a generator that prints, and draws
# random numbers, while an item is drawn, and prints after its last item:
# what runs while an item is drawn belongs to the iteration that gets it.
GENERATOR_MAIN_LOOP = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)


    def epochs(n):
        print("data ready")
        for epoch in range(n):
            data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
            print("epoch", epoch, "drawn", round(data[0][0].sum().item(), 4))
            yield epoch, data
        print("every epoch drawn")


    for epoch, data in epochs(5):
        for x, y in data:
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        print(epoch, round(model.weight.sum().item(), 6))
    print("done")
"""

# Gradient accumulation over the main loop's own iterations: backward()
# every step, the optimizer every third.  The gradients a step leaves are
# read by the next, so a worker starting between two optimizer steps
# printed other losses (its checkpoint held no gradients).
GRADIENT_ACCUMULATION = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accum = 3
    for step in range(8):
        i = step % 8 * 8
        loss = torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8]) / accum
        loss.backward()
        if (step + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
        print(step, round(loss.item(), 6))
    print("weight", round(model.weight.sum().item(), 6))
"""

# The same, cleared at each window's start: a zero_grad() under an `if`
# comes first in the body, yet the gradients of the window's earlier steps
# are read by its later ones.
GRADIENT_WINDOW = GRADIENT_ACCUMULATION.replace(
    "        loss.backward()\n",
    "        if step % accum == 0:\n            opt.zero_grad()\n        loss.backward()\n")

# The manual API's main loop, accumulating as above.
GRADIENT_ACCUMULATION_MANUAL = GRADIENT_ACCUMULATION.replace(
    "    import torch\n", "    import flor\n    import torch\n").replace(
    "for step in range(8):", "for step in flor.generator(range(8), state=(model, opt)):")
