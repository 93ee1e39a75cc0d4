"""A run's configuration: what the script parsed from its command line,
defaults included, or the config object it built (a dataclass, an OmegaConf
DictConfig as Hydra hands one over), stored with the record as its main
loop begins, and used for the dataframe's columns and the plot's labels."""
import argparse
import dataclasses
import pathlib
import sys

import pytest

from conftest import flor, runs, store, write_script
from flor import config, frames


def _parsed(words):
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/a"))
    p.add_argument("--layers", type=int, nargs="+", default=[2, 3])
    args = p.parse_args(words)  # noqa: F841 (found in this frame)
    return config.capture(sys._getframe())


@pytest.mark.unit
def test_argparse_defaults_are_part_of_the_configuration():
    assert _parsed(["--lr", "0.5"]) == {"lr": 0.5, "batch_size": 8, "out": "runs/a",
                                        "layers": [2, 3]}


@dataclasses.dataclass
class Model:
    n_embd: int = 32
    dropout: float = 0.0


@dataclasses.dataclass
class Train:
    model: Model = dataclasses.field(default_factory=Model)
    lr: float = 3e-4
    device: str = "cpu"


@dataclasses.dataclass
class Batch:  # a dataclass of tensors is not a configuration
    x: object
    y: object


@pytest.mark.unit
def test_dataclass_configs_are_flattened_and_other_dataclasses_are_not_configs():
    import torch

    assert _cfg_and_batch(torch) == {"model.n_embd": 32, "model.dropout": 0.0, "lr": 0.01,
                                     "device": "cpu"}
    assert _batch_only(torch) is None


def _cfg_and_batch(torch):
    cfg = Train(lr=0.01)  # noqa: F841 (found in this frame)
    batch = Batch(torch.zeros(2), torch.ones(2))  # noqa: F841
    return config.capture(sys._getframe())


def _batch_only(torch):
    batch = Batch(torch.zeros(2), torch.ones(2))  # noqa: F841
    return config.capture(sys._getframe())


@pytest.mark.unit
def test_an_omegaconf_config_is_flattened():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"optim": {"lr": 0.1, "betas": [0.9, 0.99]},
                                      "epochs": 4, "name": None})
    assert _omegaconf(cfg) == {"optim.lr": 0.1, "optim.betas": [0.9, 0.99], "epochs": 4,
                                "name": None}


def _omegaconf(c):
    cfg = c  # noqa: F841 (found in this frame)
    return config.capture(sys._getframe())


@pytest.mark.unit
def test_a_jsonargparse_namespace_is_flattened():
    jsonargparse = pytest.importorskip("jsonargparse")
    p = jsonargparse.ArgumentParser()
    p.add_argument("--model.n_embd", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    cfg = p.parse_args(["--lr", "0.5"])  # noqa: F841 (found in this frame)
    assert config.capture(sys._getframe()) == {"model.n_embd": 32, "lr": 0.5}


@pytest.mark.unit
def test_the_innermost_binding_of_a_key_wins():
    outer = argparse.Namespace(lr=1.0, epochs=2)  # noqa: F841

    def inner():
        args = argparse.Namespace(lr=0.5)  # noqa: F841
        return config.capture(sys._getframe())

    assert inner() == {"lr": 0.5, "epochs": 2}


SCRIPT = """
    import argparse
    import torch
    from sklearn.datasets import load_digits


    def main():
        p = argparse.ArgumentParser()
        p.add_argument("--epochs", type=int, default=2)
        p.add_argument("--lr", type=float, default=0.1)
        p.add_argument("--hidden", type=int, default=16)
        args = p.parse_args()
        torch.manual_seed(0)
        X, y = load_digits(return_X_y=True)
        X, y = torch.tensor(X[:200], dtype=torch.float32) / 16, torch.tensor(y[:200])
        net = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                  torch.nn.Linear(args.hidden, 10))
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        for epoch in range(args.epochs):
            for i in range(0, 200, 50):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(X[i:i + 50]), y[i:i + 50])
                loss.backward()
                opt.step()
            print(f"epoch {epoch} loss {loss.item():.4f}")


    if __name__ == "__main__":
        main()
"""


def test_a_record_stores_what_argparse_parsed_and_its_frames_use_it(tmp_path, monkeypatch):
    """Hands-free, the arguments parsed in main(): the defaults are stored
    (a run made with them is not NaN), flor's own options are not, and a
    replay with its record's arguments has its record's configuration."""
    d = str(tmp_path)
    write_script(d, "train.py", SCRIPT)
    flor(d, "record", "--no-adaptive", "train.py")  # every default
    flor(d, "record", "--no-adaptive", "train.py", "--lr", "0.05")
    st = store(d)
    first, second = runs(st, "record")
    assert first["info"].config == {"epochs": 2, "lr": 0.1, "hidden": 16}
    assert second["info"].config == {"epochs": 2, "lr": 0.05, "hidden": 16}
    shown = flor(d, "show", first["run_id"]).stdout
    assert "config:              epochs=2 lr=0.1 hidden=16" in shown, shown

    flor(d, "replay", "train.py", "--lr", "0.05")
    (replay,) = runs(st, "replay")
    assert frames.script_args(replay, st) == second["info"].config

    import flor as flor_api

    monkeypatch.setenv("FLOR_DIR", str(tmp_path / ".flor"))
    df = flor_api.dataframe("stdout@train.py:24", script="train.py")
    assert list(df.columns[2:5]) == ["epochs", "lr", "hidden"]
    by_run = df.groupby("run")["lr"].first().to_dict()
    assert by_run == {first["run_id"]: 0.1, second["run_id"]: 0.05, replay["run_id"]: 0.05}
