"""The page at / (server/page.py), driven in headless Chromium as a person uses it: it shows what the server
serves, sends the sample frames through /v1/actions/generations, and plots exactly the actions that route
answers; behind --api-key it asks for the key. And /stats, the JSON it reads the last minute's figures from.

Screenshots of each browser test are saved in tests/output/ (not tracked)."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from playwright.sync_api import expect
from test_server import GENERATIONS, ServerProcess, make_observation, request_body

from vlaserve.server import ServerSettings, create_app
from vlaserve.server.metrics import RecentRequests
from vlaserve.server.page import STATIC

SCREENSHOTS = Path(__file__).parent / "output"
CHECKING = "checking the key…"  # page.js shows it while a key's metadata request runs
SAMPLES = ("base.jpg", "left_wrist.jpg", "right_wrist.jpg")  # page.js sends them to the cameras in this order


def screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=SCREENSHOTS / name, full_page=True)


def test_the_page_plots_exactly_the_actions_its_request_gets(page, demo_server):
    meta = httpx.get(demo_server.url + "/v1/actions/metadata").json()
    page.goto(demo_server.url + "/")
    assert meta["model"] == "demo-pi05-v1"
    expect(page.locator("#served-name")).to_have_text(meta["model"])  # waits for the page's metadata request
    assert page.locator("#info-cameras").inner_text() == ", ".join(meta["cameras"])
    assert page.locator("#info-state").inner_text() == "14"
    tiles = page.locator(".camera")
    assert [tiles.nth(i).get_attribute("data-camera") for i in range(tiles.count())] == meta["cameras"]
    page.wait_for_function("document.querySelectorAll('.camera img').length === 3")  # the demo's sample frames
    assert page.locator("#state").input_value() == ", ".join(["0"] * 14)

    with page.expect_request(lambda r: r.url.endswith(GENERATIONS)) as sent:
        page.click("#generate")
    page.locator("#plot polyline").nth(13).wait_for()
    screenshot(page, "page.png")

    # The request is the one the page promises: the sample files' bytes as data: URLs, zeros, the task, seed, steps.
    body = json.loads(sent.value.post_data)
    images = body["input"]["observation"]["images"]
    for camera, sample in zip(meta["cameras"], SAMPLES, strict=True):
        prefix, _, encoded = images[camera].partition(",")
        assert prefix == "data:image/jpeg;base64"
        assert base64.b64decode(encoded) == (STATIC / "samples" / sample).read_bytes()
    assert body["input"]["observation"]["state"] == [0] * 14
    assert body["parameters"] == {"seed": 0, "num_inference_steps": 10}
    assert body["input"]["task"] == page.locator("#task").input_value()

    # Made directly, the same request gets the same actions, bit for bit: the same server, inputs and seed, a
    # batch of one both times on the CPU in float32; and JSON carries each float exactly both ways.
    direct = httpx.post(demo_server.url + GENERATIONS, json=body, timeout=60)
    assert direct.status_code == 200, direct.text
    actions = direct.json()["data"][0]["action"]["values"]
    lines = page.locator("#plot polyline")
    plotted = [json.loads(lines.nth(d).get_attribute("data-values")) for d in range(lines.count())]
    assert np.asarray(actions).shape == (50, 14)
    assert plotted == np.asarray(actions).T.tolist()
    assert json.loads(page.locator("#plot").get_attribute("data-actions")) == actions
    for d in range(14):  # each line is drawn through its 50 points
        assert len(lines.nth(d).get_attribute("points").split()) == 50
    for stage in ("decode_ms", "preprocess_ms", "prefix_ms", "denoise_ms"):
        assert page.locator(f'.legend [data-stage="{stage}"] b').inner_text().endswith(" ms")


def test_the_page_shows_the_api_errors_message_as_it_comes(page, demo_server):
    page.goto(demo_server.url + "/")
    page.wait_for_function("document.querySelectorAll('.camera img').length === 3")
    page.fill("#steps", "0")
    with page.expect_request(lambda r: r.url.endswith(GENERATIONS)) as sent:
        page.click("#generate")
    page.locator("#error-message").wait_for()
    refused = httpx.post(demo_server.url + GENERATIONS, json=json.loads(sent.value.post_data), timeout=60)
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert page.locator("#error-message").inner_text() == error["message"]
    assert page.locator("#error-head").inner_text() == f"422 {error['type']} · {error['field']}"
    assert page.locator("#output").is_hidden()


@pytest.fixture(scope="module")
def keyed_demo_server(demo_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed_demo_server")
    proc = ServerProcess(["--device", "cpu", "--dtype", "float32", "--api-key", "right-key"], tmp / "server.log",
                         env={"VLASERVE_CACHE": str(demo_server.cache), "HF_HUB_OFFLINE": "1"})
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


def test_behind_an_api_key_the_page_asks_for_it(page, keyed_demo_server):
    url = keyed_demo_server.url
    refused = httpx.get(url + "/v1/actions/metadata", headers={"Authorization": "Bearer wrong-key"})
    assert refused.status_code == 401
    message = refused.json()["error"]["message"]

    page.goto(url + "/")
    page.locator("#auth").wait_for()
    page.wait_for_function("document.getElementById('auth-message').textContent !== ''")
    assert page.locator("#auth-message").inner_text() == message  # asked: no key sent yet
    assert page.locator("#api-key").is_visible() and page.locator(".camera").count() == 0

    page.fill("#api-key", "wrong-key")
    with page.expect_response(lambda r: r.url.endswith("/v1/actions/metadata")) as answered:
        page.click("#auth-form button")
    assert answered.value.status == 401
    expect(page.locator("#auth-message")).not_to_have_text(CHECKING)  # the page has read the answer
    assert page.locator("#auth-message").inner_text() == message
    screenshot(page, "page-api-key.png")

    page.fill("#api-key", "right-key")
    page.click("#auth-form button")
    expect(page.locator("#served-name")).to_have_text("demo-pi05-v1")
    expect(page.locator("#auth-message")).to_have_text("key accepted")
    page.wait_for_function("document.querySelectorAll('.camera img').length === 3")

    page.fill("#api-key", "wrong-key")  # the key changed to a wrong one: the generation's own 401 too
    page.click("#auth-form button")
    expect(page.locator("#auth-message")).to_have_text(message)
    page.click("#generate")
    page.locator("#error-message").wait_for()
    assert page.locator("#error-head").inner_text() == "401 unauthorized"
    assert page.locator("#error-message").inner_text() == message


# ---- /stats --------------------------------------------------------------------------------------------
def test_stats_reports_the_last_minutes_inference_requests(golden_policy):
    with TestClient(create_app(golden_policy, ServerSettings())) as client:
        before = client.get("/stats").json()
        assert before["requests"] == 0 and before["latency_ms"] is None and before["connections"] == 0
        assert before["status"] == "ok" and before["graphs"] == {"captured": 0, "total": 0}
        obs = make_observation(1, size=(32, 32))
        assert client.post(GENERATIONS, json=request_body(obs, lists=True)).status_code == 200
        assert client.post(GENERATIONS, json={"input": {}}).status_code == 422
        client.get("/healthz")  # not an inference request
        after = client.get("/stats").json()
        assert (after["requests"], after["errors"], after["connections"]) == (2, 1, 1)
        latency = after["latency_ms"]
        assert latency["p50"] == latency["p99"] > 0  # the one success's
        assert after["uptime_s"] > before["uptime_s"]

        with client.websocket_connect("/v1/actions/realtime"):
            deadline = time.monotonic() + 30
            while client.get("/stats").json()["websocket_sessions"] != 1:
                assert time.monotonic() < deadline, "the session never showed in /stats"
                time.sleep(0.01)


def test_recent_requests_keep_one_minute(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    recent = RecentRequests(window_s=60.0)
    recent.add(200, 5.0, "gone")  # leaves the window below
    now[0] += 30
    for i in range(100):  # 10, 20, ..., 1000 ms
        recent.add(200, (i + 1) / 100, ("10.0.0.1", 5000 + i % 2))
    recent.add(422, 0.001, ("10.0.0.1", 5000))
    now[0] += 45
    summary = recent.summary()
    # numpy's linear percentiles of 10..1000 ms: p50 between 500 and 510, p99 between 990 and 1000.
    assert summary["latency_ms"] == pytest.approx({"p50": 505.0, "p99": 990.1})
    assert (summary["requests"], summary["errors"], summary["connections"]) == (101, 1, 2)
    now[0] += 31
    assert recent.summary() == {"window_s": 60.0, "requests": 0, "errors": 0, "latency_ms": None, "connections": 0}
