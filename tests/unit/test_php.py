"""bridge.phorge.php: task data as JSON that PHP's ``json_decode`` reads back unchanged.

The ``http_build_query`` encoder is compared with PHP itself in ``test_feed_handler.py``.
"""

from __future__ import annotations

import math

import pytest

from bridge.phorge.php import decode_data, encode_data


@pytest.mark.parametrize(
    "data, text",
    [
        ({"key": 7713765376809813936}, '{"key":7713765376809813936}'),
        (2, "2"),
        (None, "null"),
        ([], "[]"),
        ({"a": [1, "x", None, True]}, '{"a":[1,"x",null,true]}'),
        ({"ü": "€"}, '{"\\u00fc":"\\u20ac"}'),
    ],
)
def test_encode_data_is_compact_and_exact(data, text):
    assert encode_data(data) == text
    assert decode_data(text) == (data, None)


def test_big_integers_never_pass_through_a_float():
    key = 2**63 - 1
    data, error = decode_data(encode_data({"key": key}))
    assert error is None and type(data["key"]) is int and data["key"] == key
    assert float(key) != key  # a float would have lost it


@pytest.mark.parametrize(
    "data", [{1, 2}, math.nan, {"x": math.inf}, [-math.inf], object(), b"bytes", {"k": {1}}]
)
def test_encode_data_refuses_what_json_cannot_hold(data):
    with pytest.raises(ValueError, match="JSON"):
        encode_data(data)


@pytest.mark.parametrize("raw", ['{"n": ', "{'a': 1}", "NaN", "", "[1,]"])
def test_decode_data_reports_corrupt_json(raw):
    data, error = decode_data(raw)
    assert data is None and "not valid JSON" in error


def test_decode_data_reports_a_missing_data_row():
    data, error = decode_data(None)
    assert data is None and "missing" in error
