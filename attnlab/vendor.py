"""Which plotly.js file the pages get (app/main.py serves it) and a standalone export inlines (attnlab/export.py):
the cartesian partial bundle when scripts/fetch_plotly_bundle.py has fetched it (same plotly.js version as the plotly
package), else the full bundle from the plotly package.

The fetched bundle lives beside the installed packages (<venv>/share/attnlab/), not in static/: it is a
third-party build like the plotly package itself, and the source tree holds only what the project writes. In the
client package, standard library only, so the server and the client share it without the client importing app/."""
from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

VENDOR = Path(sys.prefix) / "share" / "attnlab"


def full_bundle_path() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def plotly_js_version(bundle: Path) -> str:
    """The version in a plotly.js bundle's banner comment ('plotly.js v4.1.1')."""
    with bundle.open("rb") as handle:
        found = re.search(rb"plotly\.js[^\n]*? v([\d.]+)", handle.read(400))
    if not found:
        raise ValueError(f"{bundle} has no plotly.js version banner")
    return found.group(1).decode()


def cartesian_bundle_path(version: str) -> Path:
    return VENDOR / f"plotly-cartesian-{version}.min.js"


@functools.lru_cache
def plotly_bundle() -> Path:
    full = full_bundle_path()
    partial = cartesian_bundle_path(plotly_js_version(full))
    return partial if partial.is_file() else full
