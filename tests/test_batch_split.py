"""The batch split of /v1 requests (server/schema.py) under every malformed shape its inputs can take:
each of images, state, noise and task missing, null, of the wrong rank, ragged, or of another batch size
(issue 78: a null state in a batch was a 500). Whatever the body, the answer is a 4xx naming a field, or
per-observation results; never a 5xx.

Two levels: parse_generation directly (many examples, no model), and the whole HTTP route in process on
the golden checkpoint (fewer examples: a valid item runs the model), whose every answer must be < 500.
"""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openpi_client import msgpack_numpy

from test_server import GENERATIONS, MSGPACK
from vlaserve.processing.layouts import KeyLayout
from vlaserve.server import ServerSettings, create_app
from vlaserve.server.schema import ApiError, Generation, parse_generation
from vlaserve.types import Request

CAMERAS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
IDENTITY = {"model": "m", "names": {"m"}, "num_inference_steps": 10}
LAYOUT = KeyLayout(CAMERAS)
MISSING = object()  # the field left out of the body
_SETTINGS = dict(derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))


# How a field is given. The split's cases come from combining them: a batch of B beside a null, a ragged
# list, another B, one observation's value, too many dims... ("batch" is listed twice: most bodies are batches).
KINDS = ("missing", "null", "scalar", "one", "batch", "batch", "other_batch", "ragged", "rank_plus_2", "junk_list")


@st.composite
def _field(draw, kind: str, size: int, shape: tuple, dtype):
    if kind == "missing":
        return MISSING
    if kind == "null":
        return None
    if kind == "scalar":
        return draw(st.one_of(st.integers(-3, 3), st.text(max_size=3)))
    if kind == "one":
        return np.zeros(shape, dtype)
    if kind in ("batch", "other_batch"):
        n = size if kind == "batch" else draw(st.integers(0, 4).filter(lambda n: n != size))
        return np.zeros((n, *shape), dtype) if draw(st.booleans()) else [np.zeros(shape, dtype)] * n
    if kind == "ragged":  # one item of another size or rank
        items = [np.zeros(shape, dtype) for _ in range(size)]
        items[draw(st.integers(0, size - 1))] = np.zeros(draw(st.lists(st.integers(0, 3), max_size=4)), dtype)
        return items
    if kind == "rank_plus_2":
        return np.zeros((size, 1, *shape), dtype)
    return draw(st.lists(st.one_of(st.none(), st.integers(), st.binary(max_size=4), st.text(max_size=2)),
                         min_size=1, max_size=3))


@st.composite
def _bodies(draw) -> dict:
    """A valid batch of B, then one to three of its fields (a camera counts as one) given another way."""
    size = draw(st.integers(1, 3))
    cameras = draw(st.lists(st.sampled_from(CAMERAS), min_size=1, max_size=3, unique=True))
    fields = [*(f"images.{cam}" for cam in cameras), "state", "noise", "task"]
    changed = draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    kind = {f: draw(st.sampled_from(KINDS)) if f in changed else "batch" for f in fields}
    images = {cam: draw(_field(kind[f"images.{cam}"], size, (4, 4, 3), np.uint8)) for cam in cameras}
    tasks = {"missing": st.just(MISSING), "null": st.none(), "scalar": st.integers(), "one": st.just("pick"),
             "batch": st.just(["pick"] * size), "other_batch": st.lists(st.just("pick"), max_size=4),
             "ragged": st.lists(st.one_of(st.just("pick"), st.none(), st.integers()), min_size=size, max_size=size),
             "rank_plus_2": st.just([["pick"]] * size), "junk_list": st.lists(st.binary(max_size=2), max_size=3)}
    return {"images": draw(st.sampled_from([{c: v for c, v in images.items() if v is not MISSING}, MISSING, None]))
            if draw(st.integers(0, 9)) == 0 else {c: v for c, v in images.items() if v is not MISSING},
            "state": draw(_field(kind["state"], size, (14,), np.float32)),
            "noise": draw(_field(kind["noise"], size, (50, 32), np.float32)),
            "task": draw(tasks[kind["task"]])}


_BODIES = _bodies()


def _body(fields: dict) -> dict:
    observation = {k: fields[k] for k in ("images", "state", "noise") if fields[k] is not MISSING}
    inp = {"observation": observation}
    if fields["task"] is not MISSING:
        inp["task"] = fields["task"]
    return {"input": inp, "parameters": {"num_inference_steps": 1}}


@settings(max_examples=1500, **_SETTINGS)
@given(_BODIES)
def test_the_split_answers_any_shape_with_a_4xx_naming_a_field_or_per_observation_results(fields):
    try:
        generation = parse_generation(_body(fields), IDENTITY, LAYOUT, msgpack_response=True)
    except ApiError as e:
        assert e.status == 422 and e.field, e.body()
        return
    assert isinstance(generation, Generation)
    for item in generation.requests:
        assert isinstance(item, Request) or (isinstance(item, ApiError) and 400 <= item.status < 500 and item.field)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_a_null_state_in_a_batch_is_a_422_naming_the_state(encoding):
    body = {"input": {"task": "pick", "observation": {"images": {"base_0_rgb": np.zeros((2, 4, 4, 3), np.uint8)},
                                                      "state": None}}}
    with pytest.raises(ApiError) as refused:
        parse_generation(body, IDENTITY, LAYOUT, msgpack_response=encoding == "msgpack")
    assert (refused.value.status, refused.value.field) == (422, "input.observation.state")
    assert "2 observations" in refused.value.message


@pytest.fixture(scope="module")
def client(golden_policy):
    with TestClient(create_app(golden_policy, ServerSettings())) as c:
        yield c


@settings(max_examples=50, **_SETTINGS)
@given(fields=_BODIES, as_json=st.booleans())
def test_the_route_never_answers_a_malformed_batch_with_a_5xx(client, fields, as_json):
    body = _body(fields)
    if as_json:
        response = client.post(GENERATIONS, content=_json(body), headers={"Content-Type": "application/json"})
    else:
        response = client.post(GENERATIONS, content=msgpack_numpy.packb(body), headers={"Content-Type": MSGPACK})
    assert response.status_code < 500, response.content[:300]


def _json(body) -> bytes:
    """JSON with arrays as nested lists and bytes as text (what a JSON client can send)."""
    import json

    def plain(value):
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, bytes):
            return value.decode("latin-1")
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return json.dumps(plain(body)).encode()
