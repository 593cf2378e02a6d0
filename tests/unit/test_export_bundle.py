"""attnlab/export.py's bundle of the front end: the embedded view's modules, read from static/js, with every
relative import renamed for the browser loader (blob: URLs), dependencies listed before the modules that import
them, and nothing of static/js left out or copied."""
from __future__ import annotations

import json
import re

import pytest

from attnlab.export import ENTRY, STATIC_JS, module_sources, standalone_html

RELATIVE = re.compile(r"""(from|import)\s*\(?\s*["']\.{1,2}/""")


def test_bundle_holds_the_views_modules_dependencies_first():
    sources = module_sources()
    order = list(sources)
    assert order[-1] == ENTRY
    # the page's own views, as files of static/js
    for path in ["views/heatmap.js", "views/headview.js", "views/effects.js", "views/scales.js", "mathx.js", "dom.js", "colors.js"]:
        assert path in sources and (STATIC_JS / path).is_file()
    for path, code in sources.items():
        assert not RELATIVE.search(code), f"{path} keeps a relative import"
        for dep in re.findall(r"attnlab-module:([\w./-]+)", code):
            assert order.index(dep) < order.index(path), f"{dep} must come before {path}"
        # the same code as the file, only its specifiers renamed
        original = (STATIC_JS / path).read_text(encoding="utf-8")
        assert re.sub(r"attnlab-module:[\w./-]+", "X", code) == re.sub(r"\.{1,2}/[\w./-]+\.js", "X", original)


def test_an_import_cycle_or_a_path_outside_static_js_is_refused():
    files = {"a.js": 'import { b } from "./b.js";', "b.js": 'import { a } from "./a.js";'}
    with pytest.raises(ValueError, match="import cycle"):
        module_sources("a.js", files.__getitem__)
    with pytest.raises(ValueError, match="outside static/js"):
        module_sources("a.js", {"a.js": 'import "../../x.js";'}.__getitem__)


def test_the_page_inlines_data_without_a_closing_script_tag():
    response = {"model": "m", "tokens": ["</script><b>", "x"], "layers": [0], "heads": [0],
                "attention": [[[[1.0, 0.0], [0.5, 0.5]]]], "scores": None, "native_beta": 1.0}
    page = standalone_html(response, request={"model": "m", "text": "</script> x"})
    start = page.index('<script type="application/json" id="attnlab-data">')
    data = page[page.index(">", start) + 1: page.index("</script>", start)]  # the first closing tag is its own
    assert json.loads(data)["response"]["tokens"] == response["tokens"]
    assert "&lt;/script&gt; x" in page.split("<body>")[0]  # the title, escaped
    assert " src=" not in page  # nothing is fetched: every script is inline
