"""/docs: Swagger UI served by the app itself (no CDN), under the strict CSP, listing the API's operations."""
from tests.browser.conftest import screenshot


def test_api_docs_render_offline_with_every_operation(page, page_log, live_server):
    page.goto(live_server + "/docs")
    page.wait_for_selector(".swagger-ui .opblock", timeout=30_000)
    paths = page.locator(".swagger-ui .opblock-summary-path").all_inner_texts()
    assert any("/api/text/attention" in p for p in paths) and any("/api/models" in p for p in paths)
    screenshot(page, "api-docs")
    page_log.check()  # no console errors (a CSP refusal would be one) and nothing requested off the host
