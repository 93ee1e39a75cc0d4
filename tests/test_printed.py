"""The numbers in printed lines (flor/printed.py): the shapes real training
scripts print them in."""
import math

import pytest

from flor.printed import fields, number, split, unnamed

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
    # the word language model, ImageNet, HF Trainer's dicts, torchvision
    ("| epoch   1 |   200/ 2983 batches | lr 20.00 | ms/batch 12.34 | loss  7.63",
     {"epoch": 1, "lr": 20.0, "ms/batch": 12.34, "loss": 7.63}, None),
    (" * Acc@1 75.123 Acc@5 92.456", {"Acc@1": 75.123, "Acc@5": 92.456}, None),
    ("{'loss': 2.3, 'learning_rate': 5e-05, 'epoch': 0.5}",
     {"loss": 2.3, "learning_rate": 5e-05, "epoch": 0.5}, None),
    ("train/loss 1.0 val/loss 2.0", {"train/loss": 1.0, "val/loss": 2.0}, None),
    ("img/s: 12.3", {"img/s": 12.3}, 12.3),
    # what is not a number: times, dates, fractions, a tensor's device, huge ids
    ("Time: 12:03:44", {}, None),
    ("eta: 0:12:34 loss 0.5", {"loss": 0.5}, 0.5),
    ("saved on date 2024-01-02", {}, None),
    ("Test set: Average loss: 0.0325, Accuracy: 9833/10000 (98%)", {"Average_loss": 0.0325},
     None),
    ("loss tensor(0.5000, device='cuda:0', grad_fn=<NllLossBackward0>)", {"loss": 0.5}, 0.5),
    ("seed " + "7" * 400, {}, None),
    # thousands, a sentence's full stop, filler words
    ("step 1,000 loss 0.5", {"step": 1000, "loss": 0.5}, None),
    ("Validation accuracy: 0.91.", {"Validation_accuracy": 0.91}, 0.91),
    ("Epoch 3 done. Loss 0.5", {"Epoch": 3, "Loss": 0.5}, None),
    ("In epoch 3, loss was 0.5", {"epoch": 3, "loss": 0.5}, None),
    ("step 3 of 10", {"step": 3}, None),
])
def test_named_numbers_and_a_lines_one_number(line, named, alone):
    assert fields(line) == named
    assert number(line) == alone


def test_the_first_value_of_a_name_counts_and_nan_is_a_number():
    assert fields("loss 0.5 loss 0.7") == {"loss": 0.5}
    assert math.isnan(fields("loss nan")["loss"]) and math.isnan(number("loss nan"))
    assert math.isinf(fields("loss NaN acc Inf")["acc"])
    assert fields("loss 12345678901234567") == {"loss": 12345678901234567}  # exact


def test_a_statements_own_value_is_a_number_its_line_does_not_name():
    assert unnamed("0.2314") == 0.2314 and unnamed("tensor(0.52)") == 0.52
    assert unnamed("loss 0.5") is None and unnamed("epoch 3 loss 0.5") is None


def test_a_field_is_named_after_the_statement():
    assert split("stdout@src/train.py:24/val_loss") == ("stdout@src/train.py:24", "val_loss")
    assert split("stdout@train.py:new:7/acc") == ("stdout@train.py:new:7", "acc")
    assert split("stdout@train.py:24") == ("stdout@train.py:24", None)
    assert split("loss/x") == ("loss/x", None)  # a logged name keeps its slash
