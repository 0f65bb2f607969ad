"""/docs works on an air-gapped robot LAN: the page loads Swagger UI from the server itself, and that
Swagger UI reads the OpenAPI 3.1 schema FastAPI writes (Swagger UI 4 cannot: it shows "Unable to render
this definition"), as a browser shows it."""

import re

from fastapi.testclient import TestClient

from vlaserve.server import ServerSettings, create_app


def test_docs_page_and_its_assets_come_from_the_server(golden_policy):
    with TestClient(create_app(golden_policy, ServerSettings())) as client:
        page = client.get("/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "cdn.jsdelivr.net" not in page.text and "/docs-assets/swagger-ui-bundle.js" in page.text
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
            response = client.get(f"/docs-assets/{asset}")
            assert response.status_code == 200 and len(response.content) > 10_000
        schema = client.get("/openapi.json").json()
        assert schema["info"]["title"] == "vlaserve" and schema["openapi"].startswith("3.1")


def test_docs_render_in_a_browser_and_try_it_out_answers(page, demo_server):
    requested = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(demo_server.url + "/docs")
    operations = page.locator(".opblock")
    operations.first.wait_for()
    listed = {page.locator(".opblock-summary-path").nth(i).get_attribute("data-path")
              for i in range(operations.count())}
    assert {"/healthz", "/metrics", "/v1/actions/metadata", "/v1/actions/generations"} <= listed
    assert "Unable to render" not in page.content()

    # "Try it out" as it stands: the metadata, and a generation from the schema's example body.
    for path, answer in (("/v1/actions/metadata", r'"model":\s*"demo-pi05-v1"'),
                         ("/v1/actions/generations", r'"object":\s*"action.generation"')):
        operation = page.locator(".opblock", has=page.locator(f'[data-path="{path}"]'))
        operation.locator(".opblock-summary").click()
        operation.get_by_role("button", name="Try it out").click()
        operation.get_by_role("button", name="Execute").click()
        status = operation.locator(".live-responses-table tbody .response-col_status")
        status.wait_for()
        assert status.inner_text().strip() == "200", operation.locator(".live-responses-table").inner_text()
        assert re.search(answer, operation.locator(".live-responses-table").inner_text())
    assert all(url.startswith(demo_server.url) for url in requested), requested  # nothing from a CDN
