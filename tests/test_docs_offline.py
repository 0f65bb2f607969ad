"""/docs works on an air-gapped robot LAN: the page loads Swagger UI from the server itself."""

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
        assert client.get("/openapi.json").json()["info"]["title"] == "vlaserve"
