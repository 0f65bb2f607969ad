"""Issue 12, in process: decoders, limits, batch isolation, error shapes, options. No server process."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlaserve.options import UsageError, serve_options
from vlaserve.batcher import Batcher
from vlaserve.errors import NonFiniteActions
from vlaserve.types import Observation, Request
from vlaserve.server import ServerSettings, create_app
from vlaserve.server.codec import MAX_NESTING_DEPTH, DecodeError, loads_json, packb, unpackb
from vlaserve.server.logs import RepeatLimit
from vlaserve.processing.layouts import KeyLayout
from vlaserve.server.openpi import request_from_openpi
from vlaserve.server.schema import ApiError, parse_generation

METADATA = {"model": "m", "names": {"m", "/c"}, "cameras": ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"],
            "action_horizon": 50, "max_action_dim": 32, "action_dim": 14, "num_inference_steps": 10}


LAYOUT = KeyLayout(tuple(METADATA["cameras"]))


class _FakeService:  # what request_from_openpi reads
    layout = LAYOUT
    identity = METADATA


# ---- fuzz: the HTTP and websocket decoders -----------------------------------------------------
# JSON-ish values, including the shapes the schema looks at, so that the fuzzer gets past decoding.
_leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20))
_values = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(
        ["input", "observation", "images", "state", "task", "prompt", "noise", "rtc", "prev_chunk", "parameters",
         "runtime", "base_0_rgb", "observation/state", "observation/image", "x"]), inner, max_size=5)),
    max_leaves=30)
_FUZZ = settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


def _http_pipeline(payload: bytes, fmt: str) -> None:
    """What the HTTP route does with a body, minus inference: only DecodeError or ApiError may escape."""
    try:
        body = unpackb(payload) if fmt == "msgpack" else loads_json(payload)
    except DecodeError:
        return
    try:
        parse_generation(body, METADATA, LAYOUT, msgpack_response=fmt == "msgpack")
    except ApiError as e:
        assert 400 <= e.status < 500


def _openpi_pipeline(payload: bytes) -> None:
    try:
        request_from_openpi(unpackb(payload), _FakeService())
    except (DecodeError, ApiError):
        pass


@_FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_give_only_decode_or_request_errors(data):
    _http_pipeline(data, "json")
    _http_pipeline(data, "msgpack")
    _openpi_pipeline(data)


@_FUZZ
@given(_values)
def test_fuzz_structured_bodies_give_only_request_errors(value):
    _http_pipeline(json.dumps(value).encode(), "json")
    packed = msgpack.packb(value, use_bin_type=True, strict_types=False) if _packable(value) else b"\xc1"
    _http_pipeline(packed, "msgpack")
    _openpi_pipeline(packed)


def _packable(value) -> bool:
    try:
        msgpack.packb(value)
        return True
    except (OverflowError, TypeError, ValueError):
        return False


# ---- decoders: rows 3, 4, 11 ---------------------------------------------------------------------
@pytest.mark.parametrize("payload", [b"[" * 100_000 + b"]" * 100_000,
                                     b'{"state": ' + b"[" * 5000 + b"0" + b"]" * 5000 + b"}",
                                     b"[" * (MAX_NESTING_DEPTH + 1) + b"]" * (MAX_NESTING_DEPTH + 1)])
def test_deep_json_is_a_decode_error(payload):
    with pytest.raises(DecodeError, match="nested deeper than"):
        loads_json(payload)


def test_deep_msgpack_is_a_decode_error():
    for depth in (MAX_NESTING_DEPTH + 1, 100_000):
        with pytest.raises(DecodeError, match="nested deeper than"):
            unpackb(b"\x91" * depth + b"\x90")
    assert unpackb(b"\x91" * (MAX_NESTING_DEPTH - 1) + b"\x90") is not None  # within the limit


def test_lone_surrogates_and_non_utf8_are_decode_errors():
    with pytest.raises(DecodeError, match="surrogate"):
        loads_json(b'{"task": "pick \\ud800 up"}')
    with pytest.raises(DecodeError, match="not UTF-8"):
        loads_json('{"task": "x"}'.encode("utf-16"))
    with pytest.raises(DecodeError):
        unpackb(b"\x81\xa4task\xa3\xed\xa0\x80")  # the UTF-8 bytes of U+D800
    assert loads_json(b'{"task": "pick \\ud83d\\ude00 up"}')["task"] == "pick \U0001F600 up"  # a valid pair


def test_duplicate_keys_are_decode_errors():
    with pytest.raises(DecodeError, match="duplicate key 'task'"):
        loads_json(b'{"input": {"task": "a", "task": "b"}}')
    with pytest.raises(DecodeError, match="duplicate key 'input'"):
        unpackb(b"\x82\xa5input\x80\xa5input\x80")


def test_numeric_lists_become_arrays_and_msgpack_arrays_stay_zero_copy():
    body = loads_json(b'{"a": [[1, 2], [3, 4]], "b": [1, "x"], "c": []}')
    assert body["a"].shape == (2, 2) and body["b"] == [1, "x"] and body["c"] == []
    payload = packb({"x": np.arange(6, dtype=np.float32)})
    decoded = unpackb(payload)["x"]
    assert not decoded.flags.owndata  # a view of the payload's bytes, not a copy



@pytest.mark.parametrize("array", [
    np.arange(224 * 224 * 3, dtype=np.uint8).reshape(224, 224, 3), np.linspace(-1, 1, 14, dtype=np.float32),
    np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2], np.array(7, dtype=np.int64), np.zeros((0, 5), np.float32),
    np.array([True, False, True]), np.arange(10, dtype=">i4"),
], ids=["image", "state", "strided", "scalar", "empty", "bool", "big-endian"])
def test_zero_copy_msgpack_decode_equals_the_copying_decode(array):
    """openpi-client's own msgpack_numpy decoder copies each array out of the payload; ours makes
    the payload's bytes the array. Same values, dtype and shape, whatever openpi-client packed."""
    from openpi_client import msgpack_numpy

    payload = msgpack_numpy.packb({"observation": {"x": array}, "prompt": "pick"})
    copied = msgpack_numpy.unpackb(payload)["observation"]["x"]
    ours = unpackb(payload)["observation"]["x"]
    assert ours.dtype == copied.dtype and ours.shape == copied.shape
    np.testing.assert_array_equal(ours, copied)
    if array.size:
        assert not ours.flags.owndata  # a view of the payload

# ---- limits: rows 1, 5, 6 --------------------------------------------------------------------------
def _body(**parts) -> dict:
    body = {"input": {"task": "pick", "observation": {"images": {"base_0_rgb": np.zeros((8, 8, 3), np.uint8)},
                                                      "state": np.zeros(14, np.float32)}}}
    body.update(parts)
    return body


@pytest.mark.parametrize("mutate, field", [
    (lambda b: b.update(rtc={"prev_chunk": np.zeros((5, 32)), "max_guidance_weight": 1e308}), "rtc.max_guidance_weight"),
    (lambda b: b.update(rtc={"prev_chunk": np.full((5, 14), 3e38), "space": "action"}), "rtc.prev_chunk"),
    (lambda b: b.update(rtc={"prev_chunk": np.zeros((5, 32)), "inference_delay": 10**30}), "rtc.inference_delay"),
    (lambda b: b["input"]["observation"].update(noise=np.full((50, 32), 3.4e38, np.float32)), "input.observation.noise"),
    (lambda b: b["input"].update(task="x" * 4097), "input.task"),
])
def test_out_of_range_values_are_refused_before_any_work(mutate, field):
    body = _body()
    mutate(body)
    with pytest.raises(ApiError) as refused:
        parse_generation(body, METADATA, LAYOUT, msgpack_response=True)
    assert (refused.value.status, refused.value.field) == (422, field)


# ---- isolation and non-finite output: rows 1, 5 -------------------------------------------------------
class _NaNForTask:
    """A policy whose actions are NaN for the task "bad" (what overflowing inputs within the bounds do)."""

    def __init__(self):
        self.batches = []

    def launch(self, requests):
        from vlaserve.types import InferenceResult

        self.batches.append(len(requests))
        results = [InferenceResult(actions=np.full((50, 14), np.nan if r.observation.task == "bad" else 1.0, np.float32),
                                   model_actions=np.zeros((50, 32), np.float32), timings={}) for r in requests]
        return SimpleNamespace(finish=lambda: results, done=lambda: True)


def test_non_finite_actions_fail_only_their_own_request():
    policy = _NaNForTask()
    batcher = Batcher(policy, max_batch_size=4, batch_delay_ms=200)

    async def three():
        requests = [Request(Observation({}, np.zeros(14, np.float32), t), num_steps=10)
                    for t in ("good", "bad", "good")]
        return await asyncio.gather(*(batcher.submit(r) for r in requests),
                                    return_exceptions=True)

    try:
        good, bad, good2 = asyncio.run(three())
    finally:
        batcher.close()
    assert policy.batches == [3]
    assert isinstance(bad, NonFiniteActions)
    assert np.isfinite(good.actions).all() and np.isfinite(good2.actions).all()


# ---- error shapes on every route: row 13 (and the OpenPI half of row 2) ---------------------------------
@pytest.fixture()
def broken_app(golden_policy, monkeypatch):
    """The real app, whose preprocessing raises an unexpected error (a bug, not a bad request)."""
    def crash(obs):
        raise RuntimeError("a bug in preprocessing at /secret/server/path.py")

    monkeypatch.setattr(golden_policy, "prepare", crash)
    with TestClient(create_app(golden_policy, ServerSettings()), raise_server_exceptions=False) as client:
        yield client


def test_500_404_405_have_the_documented_shape_and_the_traceback_is_logged_once(broken_app, caplog):
    body = {"input": {"task": "x", "observation": {"images": {"base_0_rgb": [[[0, 0, 0]]]}, "state": [0.0] * 14}}}
    with caplog.at_level(logging.ERROR):
        crashed = broken_app.post("/v1/actions/generations", json=body)
    assert crashed.status_code == 500
    assert crashed.json()["error"]["type"] == "internal_error" and "secret" not in crashed.text
    assert len([r for r in caplog.records if r.exc_info]) == 1
    for method, path, status, kind in (("GET", "/nope", 404, "not_found"),
                                       ("GET", "/v1/actions/generations", 405, "method_not_allowed")):
        response = broken_app.request(method, path)
        assert response.status_code == status
        assert response.json()["error"]["type"] == kind and set(response.json()["error"]) == {"type", "field",
                                                                                               "message"}


def test_openpi_socket_gets_one_line_not_a_traceback(broken_app):
    with broken_app.websocket_connect("/openpi/policy") as ws:
        ws.receive_bytes()  # metadata
        ws.send_bytes(packb({"observation/image": np.zeros((8, 8, 3), np.uint8),
                             "observation/state": np.zeros(14, np.float32), "prompt": "x"}))
        text = ws.receive_text()
    assert text == "internal_error: the server failed to handle this request; see the server log"


# ---- logging: rows 9, 10 ------------------------------------------------------------------------------------
def test_repeated_log_messages_are_rate_limited_and_counted():
    now = [0.0]
    limit = RepeatLimit(burst=3, window_s=10, clock=lambda: now[0])

    def record(msg="socket.accept() out of system resource"):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    assert [limit.filter(record()) for _ in range(100)] == [True] * 3 + [False] * 97
    assert limit.filter(record("another message"))
    now[0] = 11.0
    summary = record()
    assert limit.filter(summary) and "97 more like this suppressed" in summary.msg


# ---- API key options: row 14 ------------------------------------------------------------------------------
def test_the_api_key_comes_from_one_source_and_is_never_empty(tmp_path, monkeypatch):
    monkeypatch.delenv("VLASERVE_API_KEY", raising=False)
    with pytest.raises(UsageError, match="--api-key is empty"):
        serve_options({"api_key": ""})
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert serve_options({"api_key_file": str(key_file)})["api_key"] == "s3cret"
    key_file.write_text("  \n")
    with pytest.raises(UsageError, match="--api-key-file is empty"):
        serve_options({"api_key_file": str(key_file)})
    monkeypatch.setenv("VLASERVE_API_KEY", "from-env")
    assert serve_options({})["api_key"] == "from-env"
    with pytest.raises(UsageError, match="one way"):
        serve_options({"api_key": "k"})
    monkeypatch.setenv("VLASERVE_API_KEY", "")
    with pytest.raises(UsageError, match="VLASERVE_API_KEY is empty"):
        serve_options({})


def test_msgpack_bodies_that_are_costly_to_decode_leave_the_event_loop():
    from vlaserve.server.codec import OverBudget

    cameras = {c: np.zeros((224, 224, 3), np.uint8) for c in METADATA["cameras"]}
    assert unpackb(packb(_body(input={"task": "x", "observation": {"images": cameras}})), 1024)  # in place
    with pytest.raises(OverBudget):  # an image as nested lists: 50k lists, decoded in a thread instead
        unpackb(packb({"image": np.zeros((224, 224, 3), np.uint8).tolist()}), 1024)


# ---- serve-ray's direct websockets: the redirect and its ticket (fleet/direct.py) ----------------------
def test_a_websocket_redirect_is_only_given_after_the_key_check_and_carries_a_valid_ticket(golden_policy):
    from urllib.parse import parse_qs, urlparse

    from starlette.testclient import WebSocketDenialResponse

    app = create_app(golden_policy, ServerSettings(api_key="k"))
    service = app.state.service
    service.websocket_redirect = lambda scope: None if "ticket" in scope["query_string"].decode() else "ws://replica:9/openpi/policy"
    with TestClient(app) as client:
        with pytest.raises(WebSocketDenialResponse) as wrong_key:
            with client.websocket_connect("/openpi/policy", headers={"Authorization": "Api-Key nope"}):
                pass
        assert wrong_key.value.status_code == 401
        with pytest.raises(WebSocketDenialResponse) as moved:
            with client.websocket_connect("/openpi/policy", headers={"Authorization": "Api-Key k"}):
                pass
        assert moved.value.status_code == 307
        location = urlparse(moved.value.headers["location"])
        assert (location.netloc, location.path) == ("replica:9", "/openpi/policy")
        ticket = parse_qs(location.query)["ticket"][0]
        assert service.valid_ticket(ticket)
        with client.websocket_connect(f"/openpi/policy?ticket={ticket}") as ws:  # no key: the ticket stands in
            assert "action_horizon" in unpackb(ws.receive_bytes())
    expires, _, signature = ticket.partition(".")
    assert not service.valid_ticket(f"{int(expires) + 1}.{signature}")  # tampered
    assert not service.valid_ticket(service.ticket(lifetime_s=-10))  # expired
    assert not service.valid_ticket(None) and not service.valid_ticket("garbage")
