"""parse_document: every input is a dict or a one-line FormatError, never anything else."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dcr.errors import FormatError
from nemo_dcr.protocol.jsondoc import collapse_escapes, longest_literal, nesting_depth, parse_document
from nemo_dcr.protocol.signing import Sealer, SignatureError

CAP = 1 << 20


def _refused(data: bytes, match: str, **kw) -> FormatError:
    with pytest.raises(FormatError, match=match) as e:
        parse_document(data, "ack 'acks/r0/00000001.json'", max_bytes=kw.pop("max_bytes", CAP), **kw)
    msg = str(e.value)
    assert msg.startswith("ack 'acks/r0/00000001.json': ") and "\n" not in msg
    return e.value


def _nested(depth: int, opener: str) -> bytes:
    """A document nested ``depth`` deep, counting the top-level object."""
    inner = {"[": ("[", "]"), "{": ('{"a":', "}")}[opener]
    return ('{"x":' + inner[0] * (depth - 1) + "1" + inner[1] * (depth - 1) + "}").encode()


def test_a_valid_document_parses():
    doc = {"format": "nemo-dcr/ack", "version": 3, "ratio": 0.25, "neg": -7, "ok": True, "none": None,
           "list": [1, "a", {"b": []}], "unicode": "\u00e9\u4e2d\\\"", "digest": "sha256:" + "ab" * 32}
    assert parse_document(json.dumps(doc).encode(), "d", max_bytes=CAP) == doc
    assert parse_document(json.dumps(doc, indent=1, ensure_ascii=False).encode(), "d", max_bytes=CAP) == doc


def test_over_max_bytes_is_refused_before_decoding():
    data = b'{"a":"' + b"x" * 100 + b'"}'
    assert parse_document(data, "d", max_bytes=len(data)) == {"a": "x" * 100}  # control: at the cap
    _refused(data, r": 108 bytes exceeds the limit of 107$", max_bytes=len(data) - 1)
    _refused(b"\xff" * 200, r"exceeds the limit of 100$", max_bytes=100)  # size first, not the UTF-8 error


def test_not_utf8_and_not_json():
    assert parse_document('{"a":"\u00e9"}'.encode(), "d", max_bytes=CAP) == {"a": "\u00e9"}  # control
    _refused(b'{"a":"\xc3"}', r": not UTF-8 \(")
    _refused(b'{"a":', r": not valid JSON \(Expecting value")
    _refused(b"\xef\xbb\xbf{}", r": not valid JSON")  # a BOM
    _refused(b"", r": not valid JSON")


@pytest.mark.parametrize("opener", ["[", "{"])
def test_nesting_deeper_than_max_depth_is_refused(opener):
    assert nesting_depth(_nested(16, opener)) == 16
    assert parse_document(_nested(16, opener), "d", max_bytes=CAP)  # control: at the limit
    _refused(_nested(17, opener), r": nested more than 16 deep$")
    assert parse_document(_nested(17, opener), "d", max_bytes=CAP, max_depth=17)


def test_deep_nesting_cannot_reach_the_parser():
    """200 KB of '[' made json.loads raise RecursionError; it is now refused up front."""
    with pytest.raises(RecursionError):
        json.loads("[" * 200_000)  # the hazard exists
    _refused(b"[" * 200_000, r": nested more than 16 deep$")
    _refused(b'{"a":' + b"[" * 200_000, r": nested more than 16 deep$")


def test_brackets_inside_strings_do_not_count():
    for s in ['[[[[[[[[[[[[[[[[[[[[', '\\"[[[[[[[[[[[[[[[[[[[[[[', '\\\\', 'a\\\\\\"{{{{{{{{{{{{{{{{{{{{{{{{']:
        doc = {"a": s, "b": [[[]]]}
        data = json.dumps(doc).encode()
        assert parse_document(data, "d", max_bytes=CAP) == doc
        assert nesting_depth(collapse_escapes(data)) == 4
    # an escaped backslash before a quote closes the string: the brackets after it count
    _refused(b'{"a":"\\\\",' + b"[" * 40, r"nested more than 16 deep")


def test_long_integers_are_refused_before_int():
    big = "9" * 24
    assert parse_document(f'{{"a":{big},"b":-{big}}}'.encode(), "d", max_bytes=CAP) == {"a": int(big), "b": -int(big)}
    digits_in_a_string = {"s": "1" * 40, "n": 5}  # a long digit run that is no integer
    assert parse_document(json.dumps(digits_in_a_string).encode(), "d", max_bytes=CAP) == digits_in_a_string
    _refused(f'{{"a":{big}9}}'.encode(), r": integer of 25 digits, more than 24$")
    _refused(f'{{"a":-{big}9}}'.encode(), r": integer of 25 digits, more than 24$")
    with pytest.raises(ValueError, match="digits"):
        json.loads('{"a":' + "1" * 5000 + "}")  # the hazard exists: Python's int-digit limit
    _refused(b'{"a":' + b"1" * 5000 + b"}", r": integer of 5000 digits, more than 24$")
    _refused(b'{"a":' + b"1" * 10_000_000 + b"}", r": integer of 10000000 digits", max_bytes=64 << 20)


def test_floats_and_constants():
    doc = {"a": 1.5e300, "b": -0.0, "c": 0.0}
    assert parse_document(b'{"a":1.5e300,"b":-0.0,"c":1e-400}', "d", max_bytes=CAP) == doc  # control
    _refused(b'{"a":1e999}', r": number 1e999 is out of range$")
    _refused(b'{"a":-1e999}', r": number -1e999 is out of range$")
    _refused(b'{"a":1.' + b"0" * 40 + b"}", r": number literal of 42 characters, more than 40$")
    for const in ("NaN", "Infinity", "-Infinity"):
        _refused(f'{{"a":{const}}}'.encode(), rf": {const} is not a JSON value$")


def test_duplicate_keys_are_refused_at_any_depth():
    assert parse_document(b'{"a":1,"b":{"a":2}}', "d", max_bytes=CAP) == {"a": 1, "b": {"a": 2}}  # control
    _refused(b'{"a":1,"a":1}', r": key 'a' appears more than once in one object$")
    _refused(b'{"x":[{"k":1,"j":2,"k":3}]}', r": key 'k' appears more than once")
    _refused(b'{"signature":"none","signature":"hmac-sha256:00"}', r": key 'signature' appears more than once")


@pytest.mark.parametrize("data", [b"[]", b"1", b'"s"', b"null", b"true"])
def test_top_level_must_be_an_object(data):
    assert parse_document(b"{}", "d", max_bytes=CAP) == {}  # control
    _refused(data, r": top level must be an object, got ")


def test_long_strings_are_refused_as_keys_and_values():
    n = 1000
    ok = {"a": "x" * n, "x" * n: 1, "l": [["y" * n]]}
    assert parse_document(json.dumps(ok).encode(), "d", max_bytes=CAP, max_str_chars=n) == ok  # control
    for doc in ({"a": "x" * (n + 1)}, {"x" * (n + 1): 1}, {"l": [[1, "y" * (n + 1)]]}):
        _refused(json.dumps(doc).encode(), rf": a string of {n + 1} characters, more than {n}$", max_str_chars=n)
    # escapes: a literal of 6n bytes that decodes to n characters is within the limit
    esc = b'{"a":"' + b"\\u00e9" * n + b'"}'
    assert parse_document(esc, "d", max_bytes=CAP, max_str_chars=n) == {"a": "\u00e9" * n}


def test_longest_literal_bounds_every_string():
    for s in ["", "a", 'q"q', "\\", "\\\\\"", "\u00e9" * 3, "\\u0041"]:
        data = json.dumps({"k": s}).encode()
        assert longest_literal(collapse_escapes(data)) >= len(s)


# --- no other exception, whatever the bytes ---------------------------------------------

_ALPHABET = b'[]{}",:\\ 0123456789-+.eEtrufalsnNI\xff\xc3ux'
_crafted = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from(list(_ALPHABET)), max_size=300).map(bytes),
    st.tuples(st.sampled_from([b"[", b"{", b'{"a":', b'["', b'"\\']), st.integers(0, 5000),
              st.binary(max_size=20)).map(lambda t: t[0] * t[1] + t[2]),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                 lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
                 max_leaves=30).map(lambda v: json.dumps({"v": v}).encode()),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_crafted)
def test_any_bytes_give_a_dict_or_a_one_line_format_error(data):
    try:
        doc = parse_document(data, "doc", max_bytes=1 << 16)
    except FormatError as e:
        assert str(e).startswith("doc: ") and "\n" not in str(e)
    else:
        assert isinstance(doc, dict)


def _depth(v) -> int:
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    return 0


_tricky = st.text(alphabet='[]{}"\\/ax\u00e9\n', max_size=12)


@settings(max_examples=500, deadline=None)
@given(st.recursive(st.integers() | _tricky,
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(_tricky, c, max_size=3), max_leaves=20),
       st.booleans())
def test_the_depth_scan_matches_the_structure_of_valid_documents(value, ascii_only):
    """Strings full of brackets, quotes and backslashes: the scan counts exactly the
    containers (so the depth bound is tight where json.loads reads)."""
    doc = {"v": value}
    data = json.dumps(doc, ensure_ascii=ascii_only).encode()
    assert nesting_depth(collapse_escapes(data)) == _depth(doc)
    assert longest_literal(collapse_escapes(data)) >= max((len(s) for s in _strings(doc)), default=0)


def _strings(v):
    if isinstance(v, dict):
        for k, x in v.items():
            yield k
            yield from _strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x)
    elif isinstance(v, str):
        yield v


# --- Sealer.open -------------------------------------------------------------------------

@pytest.mark.parametrize("key", [None, b"k" * 32])
def test_sealer_open_refuses_hostile_bytes_as_format_errors(key):
    sealer = Sealer(key)
    sealed = sealer.seal("ack", {"version": 1})
    assert sealer.open("ack", sealed, "ack") == {"version": 1}  # control
    for data in (b"[" * 200_000, b'{"a":' + b"1" * 5000 + b"}", b'{"a":NaN}'):
        with pytest.raises(FormatError, match=r"^ack: "):
            sealer.open("ack", data, "ack")
    with pytest.raises(FormatError, match=r"^ack: \d+ bytes exceeds the limit of 10$"):
        sealer.open("ack", sealed, "ack", max_bytes=10)
    with pytest.raises(SignatureError, match=r"^ack: no signature field$"):
        sealer.open("ack", b'{"version":1}', "ack")
