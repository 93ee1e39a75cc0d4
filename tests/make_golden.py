"""Writes the golden checkpoints the tests load: tests/data/golden-v2-base.flor
and tests/data/golden-v2.flor (version 2; the second refers to the first's
blobs and carries a tag).  tests/data/golden-v1.flor was written by version 1
of the format and is kept as it is.

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


GOLDEN_TAG = bytes(range(32))


if __name__ == "__main__":
    data = os.path.join(os.path.dirname(__file__), "data")
    obj = golden_object()
    with flor.Materializer(data, mode="inline", incremental=True, signed=False) as mat:
        mat.submit("golden-v2-base", {"float32": obj["float32"], "array": obj["array"]})
        mat.submit("golden-v2", obj, GOLDEN_TAG)
    for name in ("golden-v2-base", "golden-v2"):
        path = os.path.join(data, name + ".flor")
        print(path, os.path.getsize(path))
