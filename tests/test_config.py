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
    p.add_argument("--hub-token", default="hf_abc")
    args = p.parse_args(words)  # noqa: F841 (found in this frame)
    return config.capture(sys._getframe())


@pytest.mark.unit
def test_argparse_defaults_are_part_of_the_configuration_and_secrets_are_not():
    got = _parsed(["--lr", "0.5"])
    assert got == config.Config({"lr": 0.5, "batch_size": 8, "out": "runs/a", "layers": [2, 3],
                                 "hub_token": "***"}, parsed=True)


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


def _cfg_and_batch(torch):
    cfg = Train(lr=0.01)  # noqa: F841 (found in this frame)
    batch = Batch(torch.zeros(2), torch.ones(2))  # noqa: F841
    return config.capture(sys._getframe())


def _batch_only(torch):
    batch = Batch(torch.zeros(2), torch.ones(2))  # noqa: F841
    return config.capture(sys._getframe())


@pytest.mark.unit
def test_dataclass_configs_are_flattened_and_other_dataclasses_are_not_configs():
    import torch

    assert _cfg_and_batch(torch) == config.Config(
        {"model.n_embd": 32, "model.dropout": 0.0, "lr": 0.01, "device": "cpu"}, parsed=False)
    assert _batch_only(torch) is None


def _omegaconf(c):
    cfg = c  # noqa: F841 (found in this frame)
    return config.capture(sys._getframe())


@pytest.mark.unit
def test_an_omegaconf_config_is_flattened_with_its_interpolations_resolved():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"optim": {"lr": 0.1, "warmup_lr": "${optim.lr}"},
                                      "dim": 32, "model": {"hidden": "${dim}"}, "name": None})
    assert _omegaconf(cfg).values == {"optim.lr": 0.1, "optim.warmup_lr": 0.1, "dim": 32,
                                      "model.hidden": 32, "name": None}


def _hydra(monkeypatch, omegaconf):
    monkeypatch.setattr(sys, "argv", ["train.py", "dim=32", "optim.lr=0.01"])
    base = omegaconf.OmegaConf.create({"dim": 16, "optim": {"lr": 0.1}})
    cfg = omegaconf.OmegaConf.merge(base, omegaconf.OmegaConf.from_dotlist(sys.argv[1:]))  # noqa
    return config.capture(sys._getframe())


@pytest.mark.unit
def test_hydras_overrides_tell_which_config_the_run_used(monkeypatch):
    omegaconf = pytest.importorskip("omegaconf")
    assert _hydra(monkeypatch, omegaconf) == config.Config(
        {"dim": 32, "optim.lr": 0.01, "base.dim": 16, "base.optim.lr": 0.1}, parsed=True)


@pytest.mark.unit
def test_a_jsonargparse_namespace_is_flattened():
    jsonargparse = pytest.importorskip("jsonargparse")
    p = jsonargparse.ArgumentParser()
    p.add_argument("--model.n_embd", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    cfg = p.parse_args(["--lr", "0.5"])  # noqa: F841 (found in this frame)
    assert config.capture(sys._getframe()).values == {"model.n_embd": 32, "lr": 0.5}


def _fine_tune(argv, monkeypatch):
    """A fine-tuning script's main(): the pretraining run's arguments, loaded
    from its checkpoint, beside this run's own."""
    monkeypatch.setattr(sys, "argv", ["finetune.py", *argv])
    pre_args = argparse.Namespace(lr=1e-3, epochs=100, task="pretrain")  # noqa: F841
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args(sys.argv[1:])  # noqa: F841
    return config.capture(sys._getframe())


@pytest.mark.unit
def test_the_namespace_the_command_line_was_parsed_into_has_the_bare_keys(monkeypatch):
    """Another namespace in scope never gives its values to the run's keys:
    they are named by its variable."""
    want = {"lr": 2e-5, "epochs": 2, "pre_args.lr": 1e-3, "pre_args.epochs": 100,
            "pre_args.task": "pretrain"}
    assert _fine_tune(["--lr", "2e-5"], monkeypatch) == config.Config(want, parsed=True)
    want["lr"] = 1e-5  # no words: the parser in scope defines args' keys
    assert _fine_tune([], monkeypatch) == config.Config(want, parsed=True)


@pytest.mark.unit
def test_a_class_based_trainers_config_is_found_on_self():
    class Trainer:
        def __init__(self, args):
            self.args = args

        def train(self):
            return config.capture(sys._getframe())

    got = Trainer(argparse.Namespace(lr=0.5, epochs=3)).train()
    assert got == config.Config({"lr": 0.5, "epochs": 3}, parsed=True)


@pytest.mark.unit
def test_values_are_kept_short_and_as_json():
    args = argparse.Namespace(ids=list(range(10**6)), big=2**20000,  # noqa: F841
                              text="x" * 10**6, vocab={f"t{i}": i for i in range(10**5)},
                              lines="a\nb", nan=float("nan"))
    got = config.capture(sys._getframe()).values
    import json

    assert len(json.dumps(got)) < 4000, {k: str(v)[:80] for k, v in got.items()}
    assert set(got) == {"ids", "big", "text", "vocab", "lines", "nan"}
    assert got["lines"] == "a\nb" and got["nan"] != got["nan"]  # flor show prints it on one line


@pytest.mark.unit
def test_reading_a_functions_variables_keeps_nothing_alive():
    """f_locals leaves a snapshot of a running function's variables on its
    frame: what the script deletes after the capture must be freed."""
    import gc
    import weakref

    class Big:
        pass

    def main():
        args = argparse.Namespace(lr=0.1)  # noqa: F841
        data = Big()
        alive = weakref.ref(data)
        got = config.capture(sys._getframe())
        del data
        gc.collect()
        return got, alive() is None

    got, freed = main()
    assert got.values == {"lr": 0.1} and freed


@pytest.mark.unit
def test_namespaces_nothing_tells_apart_are_each_named_by_their_variable():
    outer = argparse.Namespace(lr=1.0, epochs=2)  # noqa: F841

    def inner():
        args = argparse.Namespace(lr=0.5)  # noqa: F841
        return config.capture(sys._getframe())

    assert inner() == config.Config({"args.lr": 0.5, "outer.lr": 1.0, "outer.epochs": 2},
                                    parsed=False)


@pytest.mark.unit
def test_a_run_without_a_parse_has_its_words_and_its_config_objects():
    """nanoGPT's shape: globals set from --key=value words, a GPTConfig
    dataclass built from them."""
    class Info:
        config = {"n_layer": 2, "n_embd": 32}
        config_parsed = False

    run = {"kind": "record", "script_name": "train.py", "info": Info(),
           "argv": ["train.py", "--learning_rate=0.01", "--n_layer=2"]}
    assert frames.script_args(run) == {"learning_rate": 0.01, "n_layer": 2, "n_embd": 32}


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
    assert first["info"].config_parsed and second["info"].config_parsed
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
