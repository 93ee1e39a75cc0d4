"""Writes tests/data/golden-v1.flor, a version-1 checkpoint that the tests load.

Run it only when the format version changes on purpose:
    python tests/make_golden.py
"""
import collections
import os

import numpy as np
import torch

import flor


def golden_object():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "float32": base,
        "view": base[1:, ::2],
        "float16": torch.linspace(-1, 1, 5, dtype=torch.float16),
        "bfloat16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "param": torch.nn.Parameter(torch.ones(2)),
        "array": np.arange(6, dtype=np.int32).reshape(2, 3),
        "od": collections.OrderedDict([("b", 1), ("a", [2, 3])]),
        "meta": {"epoch": 3, "lr": 0.5, "name": "golden", "shape": torch.Size([2, 2]),
                 "dtype": torch.bfloat16},
    }


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(__file__), "data", "golden-v1.flor")
    flor.save(golden_object(), path)
    print(path, os.path.getsize(path))
