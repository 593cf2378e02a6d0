"""The plotly.js the pages load: the same plotly.js version as the plotly package, the cartesian partial
bundle when scripts/fetch_plotly_bundle.py has fetched it (make setup), else the full bundle."""
import re

from attnlab.vendor import cartesian_bundle_path, full_bundle_path, plotly_bundle, plotly_js_version


def test_served_bundle_has_the_packages_plotly_js_version(client):
    response = client.get("/static/vendor/plotly.min.js")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/javascript")
    version = plotly_js_version(full_bundle_path())
    banner = re.search(r"plotly\.js([^\n]*?) v([\d.]+)", response.text[:400])
    assert banner and banner.group(2) == version
    partial = cartesian_bundle_path(version)
    if partial.is_file():  # fetched at setup: the smaller bundle is the one served
        assert "cartesian" in banner.group(1)
        assert len(response.content) == partial.stat().st_size < full_bundle_path().stat().st_size / 2
    else:
        assert plotly_bundle() == full_bundle_path()
