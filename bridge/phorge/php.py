"""PHP-compatible encoders: what Phorge's PHP writes and reads, byte for byte.

Task data is JSON that PHP's ``json_decode`` must read back unchanged; feed hooks are
POSTed as PHP's ``http_build_query`` would encode them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

PHP_MAX_DEPTH = 511  # json_decode's default depth (512) counts one past the deepest array
PHP_INT = range(-(2**63), 2**63)


def _check_php_readable(data: Any) -> None:
    """Refuse what PHP's ``json_decode`` would silently read as null or a float."""
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list | tuple):
            if depth >= PHP_MAX_DEPTH:
                raise ValueError(f"nested deeper than the {PHP_MAX_DEPTH} levels PHP decodes")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                stack.append((key, depth + 1))
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate") from None
        elif isinstance(value, int) and not isinstance(value, bool) and value not in PHP_INT:
            raise ValueError(f"integer {value} is outside PHP's 64-bit range")


def encode_data(data: Any) -> str:
    """JSON that PHP's ``json_decode`` reads back unchanged (integers never become floats)."""
    try:
        _check_php_readable(data)
        return json.dumps(data, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"task data cannot be encoded as JSON for PHP: {exc}") from None


def _refuse_constant(name: str) -> Any:
    # PHP's json_decode rejects NaN and Infinity; so must we.
    raise ValueError(f"{name} is not JSON")


# One decoder for every row: json.loads builds a new one for each call with an option.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def decode_data(raw: str | bytes | None) -> tuple[Any, str | None]:
    """Decode a data row; a missing, non-UTF-8 or corrupt row is an error string, never raised.

    Rows are read as bytes: MariaDB stores byte sequences (a UTF-8-encoded surrogate, say)
    that a UTF-8 connection cannot decode, and one such row must fail alone.
    """
    if raw is None:
        return None, "the task's data row is missing"
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, f"the task's data row is not valid UTF-8: {exc}"
    try:
        return _DECODER.decode(raw), None
    except ValueError as exc:
        return None, f"the task's data row is not valid JSON: {exc}"


PHP_PRECISION = 14

# PHP's urlencode() (RFC 1738 flavour) leaves only these bytes alone and turns a space
# into "+"; everything else, "~" included, becomes an upper-case %XX.
_URLENCODE_TABLE = [
    chr(b) if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "-_.") else f"%{b:02X}"
    for b in range(256)
]
_URLENCODE_TABLE[0x20] = "+"


def php_urlencode(value: str | bytes) -> str:
    """PHP's ``urlencode()`` of a UTF-8 string."""
    data = value.encode("utf-8") if isinstance(value, str) else value
    return "".join(_URLENCODE_TABLE[b] for b in data)


def php_float_to_string(value: float, precision: int = PHP_PRECISION) -> str:
    """A float as PHP's ``%.*G`` (php_gcvt) writes it, e.g. ``1.0E+25``, ``0.1``, ``-0``.

    ``precision`` is PHP's ``precision`` ini setting (14 by default; -1 = shortest).
    """
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INF" if value > 0 else "-INF"
    if precision == 0 or precision < -1:
        raise ValueError(f"unsupported PHP precision {precision}")
    negative = math.copysign(1.0, value) < 0
    magnitude = abs(value)
    if magnitude == 0:
        digits, decpt = "0", 1
    else:
        # Mode 2 of zend_dtoa: correctly rounded to `precision` significant digits;
        # mode 0 (precision -1): the shortest digits that read back as the same double.
        text = repr(magnitude) if precision == -1 else f"{magnitude:.{precision - 1}e}"
        _sign, digit_tuple, exponent = Decimal(text).as_tuple()
        digits = "".join(map(str, digit_tuple)).rstrip("0") or "0"
        decpt = len(digit_tuple) + int(exponent)
    ndigit = 17 if precision == -1 else precision
    if (decpt < -3) if decpt < 0 else (decpt > ndigit):
        exponent_value = decpt - 1
        mantissa = digits[0] + "." + (digits[1:] or "0")
        text = f"{mantissa}E{'-' if exponent_value < 0 else '+'}{abs(exponent_value)}"
    elif decpt < 0:
        text = "0." + "0" * -decpt + digits
    else:
        whole = digits[:decpt].ljust(decpt, "0") or "0"
        fraction = digits[decpt:]
        text = f"{whole}.{fraction}" if fraction else whole
    return "-" + text if negative else text


def _php_scalar(value: Any, precision: int) -> str | None:
    """A leaf value as http_build_query writes it; None means "left out" (PHP null)."""
    if value is None:
        return None
    if value is True:
        return "1"
    if value is False:
        return "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return php_float_to_string(value, precision)
    if isinstance(value, str | bytes):
        return value if isinstance(value, str) else value.decode("utf-8")
    raise TypeError(f"http_build_query: cannot encode {type(value).__name__}")


def _items(value: Mapping[Any, Any] | list[Any] | tuple[Any, ...]) -> Iterable[tuple[Any, Any]]:
    # A JSON array is a PHP list: its keys are the indexes.
    return value.items() if isinstance(value, Mapping) else enumerate(value)


def _key(key: Any) -> str:
    if key is True or key is False:
        return "1" if key else "0"
    return str(key)


def _append(parts: list[str], prefix: str, value: Any, precision: int) -> None:
    if isinstance(value, Mapping | list | tuple):
        for key, child in _items(value):
            _append(parts, f"{prefix}%5B{php_urlencode(_key(key))}%5D", child, precision)
        return
    text = _php_scalar(value, precision)
    if text is not None:
        parts.append(f"{prefix}={php_urlencode(text)}")


def http_build_query(data: Mapping[Any, Any] | list[Any], *, precision: int = PHP_PRECISION) -> str:
    """PHP's ``http_build_query($data, '', '&')`` (RFC 1738) for JSON-shaped data.

    Nested arrays become ``key[sub]=...`` with the brackets encoded (``%5B``/``%5D``), true
    and false become 1 and 0, null and empty arrays are left out.
    """
    parts: list[str] = []
    for key, value in _items(data):
        _append(parts, php_urlencode(_key(key)), value, precision)
    return "&".join(parts)
