"""A session's context is encoded at every iteration of every tracked loop,
from cached pieces: the encoding must be the one encoder's, byte for byte
(it is what rows and checkpoints are matched by)."""
import json

import pytest

from flor.context import Context, encode, iter_column, top_key

pytestmark = pytest.mark.unit  # in-process: `make check` runs these


def test_a_contexts_encoding_is_the_encoders_at_every_change():
    c = Context()
    assert c.encode() == encode([]) and c.top() == (None, None)
    outer = c.push_loop('train.py:40 "quoted" \u00e9\\', 3)
    seen = [c.encode()]  # before its first item: index -1
    for i in (0, 7, 12):
        c.set_index(outer, i)
        seen.append(c.encode())
        assert c.encode() == encode(c._identity())
        assert c.top() == (encode(['train.py:40 "quoted" \u00e9\\', 3]), i)
    c.push_block("blk \u2603", 2, c.encode(), 0, None, None, 0.0)
    c.push_plain()  # not part of the identity
    inner = c.push_loop("inner", 0)
    c.set_index(inner, 4)
    assert c.encode() == encode(c._identity())
    assert json.loads(c.encode()) == [["L", 'train.py:40 "quoted" \u00e9\\', 3, 12],
                                      ["B", "blk \u2603", 2], ["L", "inner", 0, 4]]
    assert seen[0].endswith(",-1]]") and len(set(seen)) == 4
    assert top_key("a", 1) == encode(["a", 1])


@pytest.mark.parametrize("indices", [[], [0], [3, 0, 12], [-1, 5]])
def test_the_iter_column_is_the_json_list_of_the_indices(indices):
    assert iter_column(indices) == json.dumps(indices)
    assert iter_column(iter(indices)) == json.dumps(indices)
