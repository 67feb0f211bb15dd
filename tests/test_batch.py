"""Ragged Arrow columns <-> padded tensors, and joining stage tables on sample_id."""

import pyarrow as pa
import pytest
import torch

from trajflow.errors import BatchError
from trajflow.batch import join_stages, pad_ragged, to_ragged


def test_pad_right_and_left():
    col = pa.array([[1, 2, 3], [4], []], pa.list_(pa.int32()))
    assert pad_ragged(col, 0, torch.int64).tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]
    assert pad_ragged(col, -1, torch.int64, side="left").tolist() == [[1, 2, 3], [-1, -1, 4], [-1, -1, -1]]


def test_roundtrip():
    t = torch.tensor([[0.5, 1.5, 9.0], [2.5, 9.0, 9.0]])
    arr = to_ragged(t, [2, 1])
    assert arr.to_pylist() == [[0.5, 1.5], [2.5]]


def test_join_reorders_by_sample_id_and_rejects_missing():
    a = pa.table({"sample_id": ["x", "y"], "v": [1, 2]})
    b = pa.table({"sample_id": ["y", "x"], "w": [20, 10]})
    j = join_stages([a, b])
    assert j.column("w").to_pylist() == [10, 20]
    with pytest.raises(BatchError, match="missing sample_id"):
        join_stages([a, pa.table({"sample_id": ["x"], "z": [1]})])
