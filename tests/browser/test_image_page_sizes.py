"""Issue 12, item 2: the image page offers only the sizes the server accepts (max_image_tokens). Before
the fix it always offered the native size and twice it, whatever the server would refuse."""
from __future__ import annotations

from tests.browser.test_image_page import wait_idle
from tests.faults.conftest import start_server  # noqa: F401  (fixture: a real server with its own settings)


def test_image_page_offers_only_accepted_sizes(start_server, page, page_log):  # noqa: F811
    # Here, beside the other browser tests, it shares their one Chromium (a second sync Playwright in the
    # same session fails: "Sync API inside the asyncio loop").
    # dinov2-small: 224 px native = 16² patches + CLS = 257 tokens; 448 px = 1025 tokens, over 300
    server = start_server({"default_models": ["dinov2-small"], "max_image_tokens": 300})
    server.wait_ready()
    page.goto(server.base + "/image")
    for _ in range(150):  # the first view sets the size options (the native size comes with the response)
        if page.eval_on_selector_all("#size-select option", "els => els.length"):
            break
        page.wait_for_timeout(200)
    wait_idle(page)
    options = page.eval_on_selector_all("#size-select option", "els => els.map(e => [e.value, e.textContent])")
    assert options == [["1", "224 px (native)"]], options
    page_log.check()
