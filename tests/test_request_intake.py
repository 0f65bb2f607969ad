"""What a request may carry, through the HTTP and websocket APIs (the app in process, serving the
golden checkpoint in float32 on the CPU): camera aliases as users write them, honest suggestions, an
empty task or empty images refused; PNG and JPEG images (msgpack bytes, base64, data URLs), checked
from their header before any decoding; and /docs' "Try it out" on the server's own origin.

Equalities are exact: a PNG decodes losslessly, and a JPEG to the pixels Pillow gives for it here, so
the server sees the very array the reference request sends, through the same code, in a batch of one.
"""

from __future__ import annotations

import base64
import io
import re
import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse
from openpi_client import msgpack_numpy
from PIL import Image, ImageFile

from test_server import GENERATIONS, MSGPACK, ServerProcess
from vlaserve.errors import InvalidObservation, InvalidRequest
from vlaserve.processing.encoded import decode_image
from vlaserve.types import EncodedImage
from vlaserve.server import ServerSettings, create_app

HOST = "127.0.0.1:8000"  # the in-process server's address, as its clients' Host header names it
ALIASES = {"front": "base_0_rgb", "observation.images.top": "left_wrist_0_rgb", "exterior_image_2_left": None}


@pytest.fixture(scope="module")
def client(golden_policy):
    with TestClient(create_app(golden_policy, ServerSettings(camera_aliases=ALIASES)), base_url=f"http://{HOST}") as c:
        yield c


def frame(seed: int, size=(96, 128)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def encode(pixels: np.ndarray, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **options)
    return out.getvalue()


def decoded(data: bytes) -> np.ndarray:
    """What Pillow decodes `data` to, as RGB: the pixels the server must see."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


NOISE = np.random.default_rng(7).standard_normal((50, 32)).astype(np.float32)
STATE = np.linspace(-1, 1, 14).astype(np.float32)


def body(images: dict, task: str = "pick up the red block") -> dict:
    return {"input": {"task": task, "observation": {"images": images, "state": STATE, "noise": NOISE}}}


def json_body(images: dict, task: str = "pick up the red block") -> dict:
    b = body(images, task)
    b["input"]["observation"].update(state=STATE.tolist(), noise=NOISE.tolist())
    return b


def post(client, payload: dict, as_json: bool = False):
    if as_json:
        return client.post(GENERATIONS, json=payload)
    return client.post(GENERATIONS, content=msgpack_numpy.packb(payload), headers={"Content-Type": MSGPACK})


def reply(response) -> dict:
    """The reply as a client reads it: a msgpack body answers in msgpack (SGLang's rule), JSON in JSON."""
    if response.headers["content-type"].startswith(MSGPACK):
        return msgpack_numpy.unpackb(response.content)
    return response.json()


def actions(response) -> np.ndarray:
    assert response.status_code == 200, response.content[:300]
    return np.asarray(reply(response)["data"][0]["action"]["values"], dtype=np.float32)


def error(response, status: int = 422) -> dict:
    assert response.status_code == status, response.content[:300]
    return reply(response)["error"]


def reference(client, pixels: dict) -> np.ndarray:
    """The actions for raw arrays (msgpack), the canonical camera names."""
    return actions(post(client, body(pixels)))


# ---- camera aliases, suggestions, empty fields (finding 4) ------------------------------------------
def test_a_bare_alias_works_for_nested_images_and_observation_keys(client, golden_policy):
    expected = reference(client, {"base_0_rgb": frame(1), "left_wrist_0_rgb": frame(2)})
    assert np.array_equal(actions(post(client, body({"front": frame(1), "left_wrist_0_rgb": frame(2)}))), expected)
    # A bare alias covers every key with that camera part; an alias of a whole key, that key.
    ws_obs = {"observation/front": frame(1), "observation.images.top": frame(2), "observation/state": STATE,
              "prompt": "pick up the red block", "noise": NOISE}
    with client.websocket_connect("/openpi/policy") as ws:
        ws.receive_bytes()
        ws.send_bytes(msgpack_numpy.packb(ws_obs))
        assert np.array_equal(msgpack_numpy.unpackb(ws.receive_bytes())["actions"], expected)


def test_a_name_without_camera_or_alias_gets_an_honest_hint(client):
    e = error(post(client, body({"left": frame(1)})))
    assert e["field"] == "input.observation.images.left" and e["type"] == "invalid_observation"
    assert "camera_aliases {'left': CAMERA}, or {'left': null} to ignore it" in e["message"]
    assert "did you mean" not in e["message"]  # nothing is close to "left" in its camera part
    # A typo in the camera part is suggested in the request's own style, never a prefix look-alike.
    e = error(post(client, body({"base_rgb": frame(1)})))
    assert e["message"].endswith("did you mean 'images.base_0_rgb'?")
    # ... and never a key the request already sent, nor one for a camera it already filled.
    e = error(post(client, body({"base_0_rgb": frame(1), "base_rgb": frame(2)})))
    assert "without an image so far: left_wrist_0_rgb, right_wrist_0_rgb" in e["message"]
    assert "did you mean" not in e["message"]


def test_droid_suggestions_skip_the_keys_the_request_sent(golden_policy):
    droid = {"observation/exterior_image_1_left": frame(1), "observation/exterior_image_2_left": frame(2),
             "observation/wrist_image_left": frame(3), "observation/joint_position": np.zeros(7),
             "observation/gripper_position": np.zeros(1), "prompt": "pick"}
    with pytest.raises(InvalidObservation) as raised:
        golden_policy.request(droid)  # no aliases: exterior_image_2_left feeds no camera
    assert raised.value.field == "observation/exterior_image_2_left"
    assert "exterior_image_1_left" not in raised.value.message and "did you mean" not in raised.value.message


def test_the_configured_null_alias_ignores_droids_second_camera(client):
    droid = {"observation/exterior_image_1_left": frame(1), "observation/exterior_image_2_left": frame(2),
             "observation/wrist_image_left": frame(3), "observation/state": STATE, "prompt": "pick up the red block",
             "noise": NOISE}
    with client.websocket_connect("/openpi/policy") as ws:
        ws.receive_bytes()
        ws.send_bytes(msgpack_numpy.packb(droid))
        got = msgpack_numpy.unpackb(ws.receive_bytes())["actions"]
    assert np.array_equal(got, reference(client, {"base_0_rgb": frame(1), "left_wrist_0_rgb": frame(3)}))


@pytest.mark.parametrize("task", ["", "   \n\t"])
def test_an_empty_task_is_refused(client, golden_policy, task):
    e = error(post(client, body({"base_0_rgb": frame(1)}, task=task)))
    assert e["field"] == "input.task" and "is empty" in e["message"]
    with pytest.raises(InvalidRequest, match="task: is empty"):
        golden_policy.request({"images": {"base_0_rgb": frame(1)}, "state": STATE, "task": task})


def test_empty_images_are_refused_naming_the_field(client):
    for as_json in (False, True):
        e = error(post(client, (json_body if as_json else body)({}), as_json))
        assert e["field"] == "input.observation.images" and "no camera image" in e["message"]
    with client.websocket_connect("/openpi/policy") as ws:  # every image ignored: none left
        ws.receive_bytes()
        ws.send_bytes(msgpack_numpy.packb({"observation/exterior_image_2_left": frame(1), "state": STATE,
                                           "prompt": "x"}))
        assert ws.receive_text() == "invalid_observation: images: no camera image: send at least one"


# ---- encoded images (finding 5) -----------------------------------------------------------------------
def test_png_over_msgpack_json_base64_and_data_url_equals_the_raw_arrays(client, golden_policy):
    pixels = {"base_0_rgb": frame(1), "left_wrist_0_rgb": frame(2, size=(224, 224))}
    expected = reference(client, pixels)
    pngs = {cam: encode(p, "PNG") for cam, p in pixels.items()}
    assert np.array_equal(actions(post(client, body(pngs))), expected)
    as_base64 = {cam: base64.b64encode(data).decode() for cam, data in pngs.items()}
    assert np.array_equal(actions(post(client, json_body(as_base64), as_json=True)), expected)
    as_urls = {cam: "data:image/png;base64," + text for cam, text in as_base64.items()}
    assert np.array_equal(actions(post(client, json_body(as_urls), as_json=True)), expected)
    mixed = {"base_0_rgb": pngs["base_0_rgb"], "left_wrist_0_rgb": pixels["left_wrist_0_rgb"]}
    assert np.array_equal(actions(post(client, body(mixed))), expected)
    python_api = {"images": pngs, "state": STATE, "task": "pick up the red block"}  # Policy.infer takes them too
    assert np.array_equal(golden_policy.infer(python_api, noise=NOISE).actions,
                          golden_policy.infer({**python_api, "images": pixels}, noise=NOISE).actions)


@pytest.mark.parametrize("size", [(224, 224), (480, 640)])
def test_jpeg_over_msgpack_and_data_url_equals_its_decoded_pixels(client, size):
    jpeg = encode(frame(3, size), "JPEG", quality=90)
    expected = reference(client, {"base_0_rgb": decoded(jpeg)})
    assert np.array_equal(actions(post(client, body({"base_0_rgb": jpeg}))), expected)
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    assert np.array_equal(actions(post(client, json_body({"base_0_rgb": url}), as_json=True)), expected)


def test_jpeg_bytes_over_the_openpi_websocket(client):
    jpeg = encode(frame(4), "JPEG", quality=95)
    obs = {"observation/image": jpeg, "observation/state": STATE, "prompt": "pick up the red block", "noise": NOISE}
    with client.websocket_connect("/openpi/policy") as ws:
        ws.receive_bytes()
        ws.send_bytes(msgpack_numpy.packb(obs))
        got = msgpack_numpy.unpackb(ws.receive_bytes())["actions"]
    assert np.array_equal(got, reference(client, {"base_0_rgb": decoded(jpeg)}))


def test_png_over_the_realtime_websocket(client):
    png = encode(frame(9), "PNG")
    with client.websocket_connect("/v1/actions/realtime") as ws:
        ws.receive_bytes()
        ws.send_bytes(msgpack_numpy.packb(body({"base_0_rgb": png})))
        reply = msgpack_numpy.unpackb(ws.receive_bytes())
        ws.send_bytes(msgpack_numpy.packb(body({"base_0_rgb": b"\x89PNG\r\n\x1a\n"})))  # a signature, no header
        refused = msgpack_numpy.unpackb(ws.receive_bytes())["error"]
    assert np.array_equal(reply["data"][0]["action"]["values"], reference(client, {"base_0_rgb": frame(9)}))
    assert refused["field"] == "input.observation.images.base_0_rgb" and "not a readable PNG" in refused["message"]


def test_greyscale_palette_and_rgba_pngs_become_rgb(client):
    grey = frame(5)[..., 0]
    rgba = np.dstack([frame(6), np.full((96, 128), 255, np.uint8)])
    palette = Image.fromarray(frame(7)).quantize(16)
    out = io.BytesIO()
    palette.save(out, format="PNG")
    cases = {encode(grey, "PNG"): np.repeat(grey[..., None], 3, axis=2),  # grey copied into R, G and B
             encode(rgba, "PNG"): rgba[..., :3],  # alpha dropped
             out.getvalue(): np.asarray(palette.convert("RGB"))}
    for png, rgb in cases.items():
        assert np.array_equal(actions(post(client, body({"base_0_rgb": png}))),
                              reference(client, {"base_0_rgb": rgb}))


def png_header(width: int, height: int, bit_depth: int = 8, colour: int = 2) -> bytes:
    """A PNG of the size its IHDR chunk declares, with all but a few bytes of its pixel data missing."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(64))) + chunk(b"IEND", b"")


def jpeg_header(width: int, height: int) -> bytes:
    """SOI and a baseline SOF0 for 3 components, nothing else."""
    sof = struct.pack(">BHHB", 8, height, width, 3) + b"".join(bytes([i, 0x11, 0]) for i in (1, 2, 3))
    return b"\xff\xd8" + b"\xff\xc0" + struct.pack(">H", len(sof) + 2) + sof


@pytest.mark.parametrize("header,size", [(png_header(5000, 4000), "5000x4000"),
                                         (png_header(60000, 60000), None),  # past Pillow's own bomb limit
                                         (jpeg_header(6000, 4000), "6000x4000")])
def test_a_decompression_bomb_is_refused_from_its_header(client, header, size):
    # The header alone: had the server tried to decode it, the error would be a broken image instead.
    e = error(post(client, body({"base_0_rgb": header})))
    assert e["field"] == "input.observation.images.base_0_rgb"
    assert "refused before decoding" in e["message"] and (size is None or size in e["message"])


@pytest.mark.parametrize("image,message", [
    (b"GIF89a\x01\x00\x01\x00", r"bytes are not a PNG or JPEG image \(they start with b'GIF89a\\x01\\x00'\)"),
    ("aGVsbG8gd29ybGQ=", r"bytes are not a PNG or JPEG image \(they start with b'hello wo'\)"),
    ("not base64!", "must be a base64-encoded PNG or JPEG"),
    ("data:image/gif;base64,R0lG", r"must be data:image/png;base64,\.\.\. or data:image/jpeg"),
    (png_header(64, 64, bit_depth=16, colour=0), "colour mode 'I;16'"),
    (png_header(64, 64), "a broken PNG"),  # a valid header, no pixels: refused when decoded
])
def test_bytes_that_are_no_usable_image_get_a_clear_422(client, image, message):
    e = error(post(client, body({"base_0_rgb": image})))
    assert e["field"] == "input.observation.images.base_0_rgb" and re.search(message, e["message"]), e
    assert actions(post(client, body({"base_0_rgb": frame(1)}))).shape == (50, 14)  # still serving


def test_bombs_are_refused_without_loading_a_pixel(monkeypatch):
    def no_decoding(self):
        raise AssertionError("decoding started")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    for header in (png_header(5000, 4000), png_header(60000, 60000), jpeg_header(6000, 4000)):
        with pytest.raises(InvalidObservation, match="refused before decoding"):
            decode_image(EncodedImage(header), "images.x")


def test_line_wrapped_base64_decodes_to_the_same_pixels():
    jpeg = encode(frame(8), "JPEG")
    assert np.array_equal(decode_image(EncodedImage(jpeg), "images.x"), decoded(jpeg))
    wrapped = "data:image/jpeg;base64," + "\n".join(re.findall(".{1,76}", base64.b64encode(jpeg).decode()))
    assert np.array_equal(decode_image(EncodedImage(wrapped), "images.x"), decoded(jpeg))  # as base64 tools write it


def test_the_docs_encoded_image_example_runs(golden, tmp_path):
    text = (Path(__file__).parents[1] / "docs" / "server.md").read_text()
    section = text.split("### Encoded images", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32"], tmp_path / "log")
    try:
        proc.wait_ready()
        namespace: dict = {}
        exec(code.replace("http://127.0.0.1:8000", proc.url), namespace)
        for name in ("from_json", "from_msgpack"):
            assert np.asarray(namespace[name]).shape == (50, 14), name
        assert np.array_equal(np.asarray(namespace["from_json"], np.float32), namespace["from_msgpack"])
    finally:
        assert proc.stop() == 0, proc.log()


# ---- /docs "Try it out" (finding 8) -------------------------------------------------------------------
@pytest.mark.parametrize("host,origin,allowed", [
    (HOST, f"http://{HOST}", True),  # the page /docs served: same origin
    ("localhost:8000", "http://localhost:8000", True),
    ("[::1]:8000", "http://[::1]:8000", True),
    (HOST, "http://evil.example", False),
    (HOST, "http://127.0.0.1:9000", False),  # another port is another origin
    (HOST, f"https://{HOST}", False),  # another scheme too
    ("evil.example:8000", "http://evil.example:8000", False),  # a DNS name may be rebound to this server
])
def test_same_origin_requests_pass_and_foreign_ones_stay_refused(client, host, origin, allowed):
    headers = {"Host": host, "Origin": origin}
    got = client.post(GENERATIONS, json=json_body({"base_0_rgb": frame(1, size=(8, 8)).tolist()}), headers=headers)
    metadata = client.get("/v1/actions/metadata", headers=headers)
    if allowed:
        assert got.status_code == 200 and metadata.status_code == 200, got.text
    else:
        assert error(got, 403)["type"] == "forbidden_origin" and metadata.status_code == 403


def test_same_origin_websockets_pass(client):
    with client.websocket_connect(f"ws://{HOST}/openpi/policy", headers={"Origin": f"http://{HOST}"}) as ws:
        assert msgpack.unpackb(ws.receive_bytes())["cameras"]
    with pytest.raises(WebSocketDenialResponse):
        with client.websocket_connect(f"ws://{HOST}/openpi/policy", headers={"Origin": "http://evil.example"}):
            pass
