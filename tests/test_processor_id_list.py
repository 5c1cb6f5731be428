"""Processor._check_id_list: a list of plain ints takes a C-level check (one set of types); everything else the
per-id check. Both must accept and refuse the same lists and return plain ints."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_lite.client.processor import Processor


@pytest.mark.parametrize("ids", [[1, 2, 3], (4, 5), [], [0] * 300])
def test_plain_ints_come_back_as_a_new_list_of_ints(ids):
    out = Processor._check_id_list(ids, "prompt_token_ids")
    assert out == list(ids) and type(out) is list and out is not ids and all(type(t) is int for t in out)


def test_numpy_ints_mixed_in_become_plain_ints():
    out = Processor._check_id_list([1, np.int64(2), np.int32(3)], "prompt_token_ids")
    assert out == [1, 2, 3] and all(type(t) is int for t in out)


class MyInt(int):
    pass


@pytest.mark.parametrize("bad", [[1, True], [False], [1, 2.0], [1, "2"], [None], [1, [2]]])
def test_bools_floats_and_others_are_refused(bad):
    with pytest.raises(TypeError, match="must contain only ints"):
        Processor._check_id_list(bad, "prompt_token_ids")


def test_int_subclass_is_accepted_as_a_plain_int():
    out = Processor._check_id_list([MyInt(7), 8], "prompt_token_ids")
    assert out == [7, 8] and all(type(t) is int for t in out)
