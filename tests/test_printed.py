"""The numbers in printed lines (flor/printed.py): the shapes real training
scripts print them in."""
import math

import pytest

from flor.printed import fields, number, split

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("line, named, alone", [
    # the PyTorch MNIST example
    ("Train Epoch: 1 [0/60000 (0%)]\tLoss: 2.302585", {"Train_Epoch": 1, "Loss": 2.302585},
     None),
    # nanoGPT
    ("step 100: train loss 2.3001, val loss 2.3100",
     {"step": 100, "train_loss": 2.3001, "val_loss": 2.31}, None),
    ("iter 10: loss 3.1234, time 20.51ms, mfu -100.00%", {"iter": 10, "loss": 3.1234,
                                                         "mfu": -100.0}, None),
    # makemore, a hand-written loop
    ("step 0 | loss 3.2958", {"step": 0, "loss": 3.2958}, None),
    ("epoch 3 val_acc: 0.91 lr=1e-3", {"epoch": 3, "val_acc": 0.91, "lr": 0.001}, None),
    # hindsight statements
    ("w0 norm 1.23", {"w0_norm": 1.23}, 1.23),
    ("grad norm tensor(0.52)", {"grad_norm": 0.52}, 0.52),
    ("0.2314", {}, 0.2314),
    ("x=-0.5e-2, y = +3", {"x": -0.005, "y": 3}, None),
    ("no numbers here", {}, None),
    ("model_v2 saved to ckpt_10.pt", {}, None),  # digits inside words are not numbers
])
def test_named_numbers_and_a_lines_one_number(line, named, alone):
    assert fields(line) == named
    assert number(line) == alone


def test_the_first_value_of_a_name_counts_and_nan_is_a_number():
    assert fields("loss 0.5 loss 0.7") == {"loss": 0.5}
    assert math.isnan(fields("loss nan")["loss"]) and math.isnan(number("loss nan"))


def test_a_field_is_named_after_the_statement():
    assert split("stdout@src/train.py:24/val_loss") == ("stdout@src/train.py:24", "val_loss")
    assert split("stdout@train.py:new:7/acc") == ("stdout@train.py:new:7", "acc")
    assert split("stdout@train.py:24") == ("stdout@train.py:24", None)
    assert split("loss/x") == ("loss/x", None)  # a logged name keeps its slash
