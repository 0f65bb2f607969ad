"""Issue 12, replayed against a real server process (127.0.0.1, the golden checkpoint, float32 on the
CPU): each hostile input gets a clean 4xx or error frame, and the server keeps serving others.

Liveness tests (rows 7, 9) use generous bounded waits: they check that something happens at all
(the loop answers while a big body decodes; a stalled connection gets closed), never how fast."""

from __future__ import annotations

import json
import re
import resource
import signal
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import websockets.sync.client as ws_client
from openpi_client import msgpack_numpy
from websockets.exceptions import ConnectionClosed, InvalidStatus

from test_server import (GENERATIONS, MSGPACK, ServerProcess, assert_actions, envelope_actions, make_noise,
                         make_observation, request_body)

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD_ORIGIN = "http://good.example"
MAX_CONNECTIONS = 30

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


@pytest.fixture(scope="module")
def server(golden, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    (tmp / "key").write_text(KEY + "\n")
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32",
                          "--api-key-file", str(tmp / "key"), "--allowed-origins", GOOD_ORIGIN,
                          "--max-connections", str(MAX_CONNECTIONS), "--header-timeout-s", "1",
                          "--body-timeout-s", "3", "--batch-delay-ms", "100"], tmp / "server.log")
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


def small_body(seed: int = 0, **sections) -> dict:
    obs = make_observation(seed, cameras=("base_0_rgb",), size=(24, 24))
    return request_body(obs, make_noise(seed), parameters={"num_inference_steps": 1}, **sections)


def post_mp(http, body) -> httpx.Response:
    return http.post(GENERATIONS, content=msgpack_numpy.packb(body), headers={"Content-Type": MSGPACK})


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"type", "field", "message"} and error["message"]
    return error


def assert_serving(http) -> None:
    assert post_mp(http, small_body()).status_code == 200


# ---- row 1: one bad request in a batch --------------------------------------------------------------
def test_a_bad_rtc_request_does_not_fail_the_good_ones_batched_with_it(http, golden_policy):
    previous = np.zeros((5, 32), np.float32)
    bodies = [small_body(1), small_body(2, rtc={"prev_chunk": previous, "max_guidance_weight": 1e308}), small_body(3)]
    results = [None] * 3
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, post_mp(http, bodies[i]))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert error_of(results[1], 422)["field"] == "rtc.max_guidance_weight"
    for i, seed in ((0, 1), (2, 3)):
        obs = make_observation(seed, cameras=("base_0_rgb",), size=(24, 24))
        expected = golden_policy.infer(obs, noise=make_noise(seed), num_steps=1).actions
        assert_actions(envelope_actions(msgpack_numpy.unpackb(results[i].content)), expected)  # a msgpack reply


# ---- row 2: images that resize to a side of 0 ----------------------------------------------------------
@pytest.mark.parametrize("shape", [(500, 1, 3), (1, 500, 3), (3, 2, 1000)])
def test_extreme_aspect_images_on_every_route(server, http, shape):
    image = np.zeros(shape, np.uint8)
    body = small_body()
    body["input"]["observation"]["images"] = {"base_0_rgb": image}
    error = error_of(post_mp(http, body), 422)
    assert (error["type"], error["field"]) == ("invalid_observation", "input.observation.images.base_0_rgb")
    assert "too elongated" in error["message"]

    with ws_client.connect(server.ws_url + "/v1/actions/realtime", additional_headers=AUTH, max_size=None) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb(body))
        assert msgpack_numpy.unpackb(ws.recv())["error"]["type"] == "invalid_observation"
        ws.send(msgpack_numpy.packb(small_body()))
        assert "data" in msgpack_numpy.unpackb(ws.recv())  # the session goes on
    with ws_client.connect(server.ws_url + "/openpi/policy", additional_headers=AUTH, max_size=None) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb({"observation/image": image, "observation/state": np.zeros(14, np.float32),
                                     "prompt": "x"}))
        text = ws.recv()
        assert text.startswith("invalid_observation: images.base_0_rgb: an image of") and "\n" not in text
    assert_serving(http)


# ---- rows 3, 4, 11: bodies that must not decode ----------------------------------------------------------
@pytest.mark.parametrize("payload, content_type, kind", [
    (b"[" * 100_000 + b"]" * 100_000, "application/json", "invalid_json"),
    (b'{"input": {"task": "x", "observation": {"images": {}, "state": ' + b"[" * 5000 + b"0" + b"]" * 5000 + b"}}}",
     "application/json", "invalid_json"),
    (b"\x91" * 100_000 + b"\x90", MSGPACK, "invalid_msgpack"),
    (b'{"input": {"task": "pick \\ud800 up"}}', "application/json; charset=utf-8", "invalid_json"),
    (b'{"input": {"task": "a", "task": "b"}}', "application/json", "invalid_json"),
    (b"\x82\xa5input\x80\xa5input\x80", MSGPACK, "invalid_msgpack"),  # {"input": {}, "input": {}}
])
def test_deep_surrogate_and_duplicate_bodies_are_400(http, payload, content_type, kind):
    assert error_of(http.post(GENERATIONS, content=payload, headers={"Content-Type": content_type}), 400)["type"] == kind
    assert_serving(http)


# ---- rows 5, 6: values out of range, a huge task ------------------------------------------------------------
def test_huge_noise_and_rtc_chunks_are_422_in_json_and_msgpack(http):
    noisy = small_body()
    noisy["input"]["observation"]["noise"] = np.full((50, 32), 3.4e38, np.float32)
    assert error_of(post_mp(http, noisy), 422)["field"] == "input.observation.noise"
    chunked = small_body(rtc={"prev_chunk": np.full((5, 14), 3e38, np.float32), "space": "action"})
    assert error_of(post_mp(http, chunked), 422)["field"] == "rtc.prev_chunk"
    as_json = json.loads(json.dumps({**noisy, "input": {**noisy["input"], "observation": {
        k: (v.tolist() if isinstance(v, np.ndarray) else {c: i.tolist() for c, i in v.items()})
        for k, v in noisy["input"]["observation"].items()}}}))
    assert error_of(http.post(GENERATIONS, json=as_json), 422)["field"] == "input.observation.noise"


def test_a_16_mb_task_is_refused_before_tokenizing(server, http):
    body = small_body()
    body["input"]["task"] = "pick " * (16 * 2**20 // 5)
    error = error_of(post_mp(http, body), 422)
    assert error["field"] == "input.task" and "at most 4096 characters" in error["message"]
    with ws_client.connect(server.ws_url + "/openpi/policy", additional_headers=AUTH, max_size=None) as ws:
        ws.recv()
        ws.send(msgpack_numpy.packb({"observation/image": np.zeros((24, 24, 3), np.uint8),
                                     "observation/state": np.zeros(14, np.float32), "prompt": "x" * 5000}))
        assert ws.recv().startswith("invalid_request: task: at most 4096 characters")
    assert_serving(http)


# ---- row 7: a 48 MB JSON body does not stall the loop -----------------------------------------------------
@pytest.mark.slow  # decodes 48 MB of JSON
def test_health_answers_while_a_48_mb_json_image_decodes(server, http):
    row = b"[" + b",".join([b"[255,255,255]"] * 2000) + b"]"
    image = b"[" + b",".join([row] * 1900) + b"]"
    payload = (b'{"input": {"task": "pick", "observation": {"images": {"base_0_rgb": ' + image
               + b'}, "state": ' + json.dumps([0.0] * 14).encode() + b"}}, \"parameters\": {\"num_inference_steps\": 1}}")
    assert len(payload) > 48 * 10**6
    result = {}
    big = threading.Thread(target=lambda: result.update(response=http.post(
        GENERATIONS, content=payload, headers={"Content-Type": "application/json"})))
    big.start()
    answered_meanwhile = 0
    # Bounded: 1,000 probes. Each must answer within 2 s (the loop blocked for 4.4 s before).
    for _ in range(1000):
        if not big.is_alive():
            break
        assert httpx.get(server.url + "/healthz", timeout=2.0).status_code == 200
        answered_meanwhile += 1
    big.join()
    assert result["response"].status_code == 200, result["response"].text
    assert answered_meanwhile >= 3  # the probes really ran while the body was being decoded


# ---- row 8: shutdown answers in-flight websocket requests -------------------------------------------------
def _inferences_in_flight(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    match = re.search(r"^vlaserve_inferences_in_flight (\S+)$", text, re.M)
    assert match, "/metrics has no vlaserve_inferences_in_flight gauge"
    return float(match[1])


@pytest.mark.slow  # a 100-step request in flight and one queued behind it
def test_sigterm_answers_in_flight_websocket_requests_then_closes_1012(golden, tmp_path, golden_policy):
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32"], tmp_path / "log")
    obs, noise = make_observation(7, cameras=("base_0_rgb",), size=(24, 24)), make_noise(7)
    replies, codes = {}, {}

    def realtime():
        with ws_client.connect(proc.ws_url + "/v1/actions/realtime", max_size=None) as ws:
            ws.recv()
            ws.send(msgpack_numpy.packb(request_body(obs, noise, parameters={"num_inference_steps": 100})))
            replies["realtime"] = msgpack_numpy.unpackb(ws.recv())
            with pytest.raises(ConnectionClosed):
                ws.recv()
            codes["realtime"] = ws.close_code

    def openpi():
        with ws_client.connect(proc.ws_url + "/openpi/policy", max_size=None) as ws:
            ws.recv()
            ws.send(msgpack_numpy.packb({"observation/image": obs["images"]["base_0_rgb"], "prompt": obs["task"],
                                         "observation/state": obs["state"], "noise": noise}))
            replies["openpi"] = msgpack_numpy.unpackb(ws.recv())
            with pytest.raises(ConnectionClosed):
                ws.recv()
            codes["openpi"] = ws.close_code

    try:
        proc.wait_ready()
        with ws_client.connect(proc.ws_url + "/openpi/policy", max_size=None) as idle:
            idle.recv()
            clients = [threading.Thread(target=f) for f in (realtime, openpi)]
            # The 100-step request goes in first; the OpenPI one (10 steps, its wire has no step count) then
            # queues behind it. Sent together, the short one could run and finish first, alone. Each wait is
            # paced and bounded: the SIGTERM must find both in flight, or this test proves nothing.
            deadline = time.monotonic() + 120
            for wanted, client in enumerate(clients, start=1):
                client.start()
                while _inferences_in_flight(proc.url) < wanted:
                    assert not replies and all(c.is_alive() for c in clients[:wanted]), "a request ended before the SIGTERM"
                    assert time.monotonic() < deadline, f"{wanted} request(s) were never in flight together"
                    time.sleep(0.05)
            proc.proc.send_signal(signal.SIGTERM)
            for c in clients:
                c.join(timeout=120)
            with pytest.raises(ConnectionClosed):
                idle.recv()
            assert idle.close_code == 1012
        assert proc.proc.wait(timeout=120) == 0, proc.log()
    finally:
        proc.stop()
    assert codes == {"realtime": 1012, "openpi": 1012}
    expected = golden_policy.infer(obs, noise=noise, num_steps=100).actions
    assert_actions(replies["realtime"]["data"][0]["action"]["values"], expected)
    assert replies["openpi"]["actions"].shape == (50, 14)
    assert "Traceback" not in proc.log()


# ---- rows 9, 10: half-open connections, clients that leave mid-body, slow bodies ----------------------------
def test_half_open_connections_past_the_limit_shed_the_oldest_and_time_out(server, http):
    sockets = []
    try:
        for _ in range(50):  # bounded: 50 sockets, against --max-connections 30
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"POST /v1/actions/generations HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            s.settimeout(30)  # generous: the header timeout is 1 s
            sockets.append(s)
        assert_serving(http)  # a new connection sheds the oldest parked one instead of being refused
        # Every parked connection is closed without an answer: shed (the oldest) or timed out.
        assert [s.recv(4096) for s in sockets] == [b""] * 50
    finally:
        for s in sockets:
            s.close()
    assert_serving(http)


def test_past_the_limit_with_no_idle_connection_a_new_one_gets_503(server, http):
    stalled = (f"POST {GENERATIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()
    sockets = []
    try:
        for _ in range(MAX_CONNECTIONS + 5):  # each in the middle of a request: none idle to shed
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(stalled)
            s.settimeout(30)  # generous: the body timeout is 3 s
            sockets.append(s)
        answers = [s.recv(4096) for s in sockets]
        refused = sum(a.startswith(b"HTTP/1.1 503 ") and b'"too_many_connections"' in a for a in answers)
        timed_out = sum(a.startswith(b"HTTP/1.1 408 ") for a in answers)
        assert refused >= 5 and refused + timed_out == len(sockets)
    finally:
        for s in sockets:
            s.close()
    assert_serving(http)


def test_clients_that_leave_half_way_through_a_body_log_nothing(server, http):
    head = (f"POST {GENERATIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head + b"[" * 1000)
    assert_serving(http)
    assert "Traceback" not in server.log() and "ERROR" not in server.log()


def test_a_body_that_stalls_gets_408(server):
    head = (f"POST {GENERATIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head + b"{")
        s.settimeout(60)  # generous: the body timeout is 3 s
        answer = s.recv(4096)
        while b'"request_timeout"' not in answer:  # headers and body may arrive in separate segments
            more = s.recv(4096)
            if not more:
                break
            answer += more
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in answer


# ---- row 12: media types and origins ---------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain; x=json", "application/x-www-form-urlencoded; json",
                                          "multipart/form-data; boundary=json", "text/plain; x=msgpack"])
def test_only_exact_media_types(http, content_type):
    body = json.dumps({"input": {"task": "x"}}).encode()
    assert error_of(http.post(GENERATIONS, content=body, headers={"Content-Type": content_type}),
                    415)["type"] == "unsupported_media_type"


def test_browser_origins_are_refused_unless_allowed(server, http):
    body = small_body()
    refused = http.post(GENERATIONS, content=msgpack_numpy.packb(body),
                        headers={"Content-Type": MSGPACK, "Origin": "http://evil.example"})
    assert error_of(refused, 403)["type"] == "forbidden_origin"
    for path in ("/v1/actions/realtime", "/openpi/policy"):
        with pytest.raises(InvalidStatus) as denied:
            ws_client.connect(server.ws_url + path, additional_headers=AUTH, origin="http://evil.example")
        assert denied.value.response.status_code == 403
    allowed = http.post(GENERATIONS, content=msgpack_numpy.packb(body),
                        headers={"Content-Type": MSGPACK, "Origin": GOOD_ORIGIN})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
    preflight = httpx.options(server.url + GENERATIONS, headers={
        "Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == GOOD_ORIGIN
    with ws_client.connect(server.ws_url + "/openpi/policy", additional_headers=AUTH, origin=GOOD_ORIGIN) as ws:
        assert msgpack_numpy.unpackb(ws.recv())["action_dim"] == 14


# ---- row 13 over the wire; row 14: the key file -------------------------------------------------------------------
def test_unknown_routes_and_methods_have_the_error_shape(server):
    assert error_of(httpx.get(server.url + "/nope"), 404)["type"] == "not_found"
    assert error_of(httpx.put(server.url + GENERATIONS), 405)["type"] == "method_not_allowed"


def test_the_key_from_the_file_is_required(server):
    assert error_of(httpx.post(server.url + GENERATIONS, json={}), 401)["type"] == "unauthorized"
    assert httpx.get(server.url + "/v1/actions/metadata", headers={"X-API-Key": KEY}).status_code == 200


# ---- issue 42: three HTTP-layer rows ----------------------------------------------------------------------------
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_still_uploading_gets_its_413_not_a_reset(server, framing):
    """The 413 goes out as soon as the declared length (or the bytes streamed so far) pass the limit;
    the client keeps uploading for ~1.2 s more, past the 1 s header timeout, reading nothing until it is done
    (as most HTTP clients do), and must then read the 413, not a reset connection."""
    limit, chunk = 64 * 2**20, 2**20  # the server's default --max-payload-mb
    slow = 40  # the last 40 MiB at 0.03 s each: ~1.2 s of upload after the 413, past the header timeout
    chunks = limit // chunk + slow
    framing_header = (f"Content-Length: {chunks * chunk}" if framing == "content-length"
                      else "Transfer-Encoding: chunked")
    head = (f"POST {GENERATIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{framing_header}\r\n\r\n").encode()
    piece = b"x" * chunk if framing == "content-length" else f"{chunk:x}\r\n".encode() + b"x" * chunk + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head)
        for i in range(chunks):
            s.sendall(piece)
            if i >= chunks - slow:
                time.sleep(0.03)
        if framing == "chunked":
            s.sendall(b"0\r\n\r\n")
        s.settimeout(30)
        answer = b""
        while b"}}" not in answer:  # the head and the JSON body may come in separate segments
            piece = s.recv(65536)
            if not piece:
                break
            answer += piece
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"payload_too_large"' in answer


def test_a_content_length_plus_transfer_encoding_request_is_400_and_the_connection_closes(server):
    smuggled = (f"POST {GENERATIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                "Content-Type: application/json\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
                "0\r\n\r\n"
                "GET /v1/actions/metadata HTTP/1.1\r\nHost: x\r\n\r\n").encode()  # pipelined behind it
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(smuggled)
        s.settimeout(30)
        answer = b""
        while chunk := s.recv(65536):  # read until the server closes (RFC 9112 section 6.1)
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 ") and b'"invalid_http_framing"' in answer
    assert answer.count(b"HTTP/1.1 ") == 1  # the pipelined request was never answered


def test_parked_half_header_connections_past_the_fd_limit_do_not_starve_a_normal_client(golden, tmp_path):
    """1,100 connections that never finish their headers, against a server whose open-file limit is
    1,024: the oldest idle ones are shed to make room, so a normal client is still served."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"this test opens 1,100 sockets; the hard open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    proc = ServerProcess([str(golden / "checkpoint"), "--device", "cpu", "--dtype", "float32",
                          "--header-timeout-s", "120"], tmp_path / "server.log",
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
    sockets = []
    try:
        proc.wait_ready()
        for _ in range(1100):
            s = socket.create_connection(("127.0.0.1", proc.port))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            sockets.append(s)
        with httpx.Client(base_url=proc.url, timeout=60) as client:
            assert client.get("/v1/actions/metadata").status_code == 200
        shed = 0
        for s in sockets[:100]:  # the oldest went first, closed without an answer
            s.settimeout(30)
            shed += s.recv(4096) == b""
        assert shed == 100
    finally:
        for s in sockets:
            s.close()
        assert proc.stop() == 0, proc.log()
    assert "Too many open files" not in proc.log()
