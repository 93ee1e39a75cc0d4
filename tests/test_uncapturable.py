"""State that cannot be checkpointed never ends the user's script.

Training loops carry objects that pickle cannot reduce: a running hash of
the losses, a meter guarded by a lock, an open log file, a batch generator,
weak references to the prepared model (as Accelerate keeps them).  A record
of a correct script must exit as a plain run does and print what it prints;
where a state cannot be copied, flor leaves that loop or block alone (replay
runs it again) and says once which object and why.  Each script is recorded
with every block checkpointed, then replayed with a probe added, and both
are compared with plain runs."""
import textwrap

import pytest

from conftest import flor, plain, write_script

# The C core's paths: the sanitized build runs these (make test-asan).
pytestmark = pytest.mark.core

HEAD = """
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
"""

# One training step, indented for the body of a batch loop in CASES.
STEP = """\
            loss = ((model(x[i:i + 8]) - y[i:i + 8]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()"""

CASES = {
    # A running hash of the losses: state, and pickle cannot copy it.
    "hash": ("""
    import hashlib
    h = hashlib.sha256()
    for epoch in range(3):
        for i in range(0, 32, 8):
{STEP}
            h.update(loss.detach().numpy().tobytes())
        print("epoch", epoch, round(loss.item(), 4), h.hexdigest()[:12])
    """, "h (a _hashlib.HASH) cannot be checkpointed"),
    # What pickle cannot reduce but flor copies (or leaves out as not
    # state): an Accelerate-like wrapper (weak references to what it
    # prepared, a lock, a hook list of bound methods), a meter whose lock
    # guards its totals, batches drawn from a generator, a log file.
    "wrapper": ("""
    import threading
    import weakref
    class Accelerator:
        def __init__(self):
            self._models, self._lock, self.step, self.hooks = [], threading.RLock(), 0, []
            self._refs = weakref.WeakKeyDictionary()
        def prepare(self, m):
            self._models.append(weakref.ref(m))
            self._refs[m] = len(self._models)
            self.hooks.append(m.train)
            return m
        def backward(self, loss):
            with self._lock:
                self.step += 1
            loss.backward()
    class Meter:
        def __init__(self):
            self.lock = threading.Lock()
            self.total, self.n = 0.0, 0
        def add(self, v):
            with self.lock:
                self.total += v
                self.n += 1
    def batches():
        while True:
            for j in range(0, 32, 8):
                yield j
    acc, meter, it = Accelerator(), Meter(), batches()
    model = acc.prepare(model)
    log = open("losses.txt", "w")
    for epoch in range(3):
        for _ in range(4):
            i = next(it)
            loss = ((model(x[i:i + 8]) - y[i:i + 8]) ** 2).mean()
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            meter.add(loss.item())
            log.write(f"{{loss.item():.5f}}\\n")
        print("epoch", epoch, round(meter.total / meter.n, 4), acc.step)
    log.close()
    """, "acc (a __main__.Accelerator) cannot be checkpointed: TypeError: cannot pickle "
         "'_thread.RLock' object (at acc['_lock'])"),
    # A module that refuses state_dict() (exported another way).
    "state_dict": ("""
    class Frozen(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
        def forward(self, v):
            return self.inner(v)
        def state_dict(self, *args, **kwargs):
            raise RuntimeError("export the adapter with save_adapter()")
    model = Frozen(model)
    for epoch in range(3):
        for i in range(0, 32, 8):
{STEP}
        print("epoch", epoch, round(loss.item(), 4))
    """, None),
    # A write-only property that the batch loop assigns.
    "property": ("""
    class Knob:
        def __init__(self):
            self._v = 0.0
        @property
        def value(self):
            raise RuntimeError("write-only: read it with get()")
        @value.setter
        def value(self, v):
            self._v = v
        def get(self):
            return self._v
    knob = Knob()
    for epoch in range(3):
        for i in range(0, 32, 8):
{STEP}
            knob.value = loss.item()
        print("epoch", epoch, round(knob.get(), 4))
    """, None),
    # The manual API: a block whose end() is given the hash.
    "manual": ("""
    import hashlib
    import flor
    h = hashlib.sha256()
    for epoch in flor.generator(range(3)):
        if flor.SkipBlock.step_into("train"):
            for i in range(0, 32, 8):
{STEP}
                h.update(loss.detach().numpy().tobytes())
        model, opt, h = flor.SkipBlock.end(model, opt, h)
        print("epoch", epoch, round(model.weight.sum().item(), 4), h.hexdigest()[:12])
    """, "object 2 given to end() (a _hashlib.HASH) cannot be checkpointed"),
}


def _script(body: str) -> str:
    step = STEP
    if "step_into" in body:  # one level deeper
        step = "\n".join("    " + line for line in step.splitlines())
    return textwrap.dedent(HEAD + body.format(STEP=step)).lstrip()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_state_that_cannot_be_checkpointed_never_ends_the_script(tmp_path, case):
    body, said = CASES[case]
    d = str(tmp_path)
    script = _script(body)
    # The edited script: a probe in the epoch loop.  A plain run of it
    # prints what a plain run of the script prints, and the probe's lines.
    write_script(d, "train.py", script.replace(
        '    print("epoch"',
        '    print("w", round(list(model.parameters())[0].sum().item(), 6))\n    print("epoch"'))
    edited = plain(d, "train.py").stdout
    write_script(d, "train.py", script)
    rec = flor(d, "record", "--no-adaptive", "train.py", check=False)
    expected = "".join(line for line in edited.splitlines(True) if not line.startswith("w "))
    assert (rec.returncode, rec.stdout) == (0, expected), rec.stderr
    assert "Traceback" not in rec.stderr, rec.stderr
    if said is not None:
        assert rec.stderr.count(said) == rec.stderr.count("cannot be checkpointed") >= 1, \
            rec.stderr
        assert "and replay runs it again" in rec.stderr
    # The replay of the edited script prints what a plain run of it does.
    write_script(d, "train.py", script.replace(
        '    print("epoch"',
        '    print("w", round(list(model.parameters())[0].sum().item(), 6))\n    print("epoch"'))
    rep = flor(d, "replay", "train.py")
    assert rep.stdout == edited and "w " in rep.stdout
    assert "deferred checks passed" in rep.stderr, rep.stderr
