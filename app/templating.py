"""The Jinja2 page shells."""
import functools
import posixpath
import re
from pathlib import Path

from fastapi.templating import Jinja2Templates

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "static"
templates = Jinja2Templates(directory=str(ROOT / "templates"))

_IMPORT = re.compile(r"""^\s*(?:import|export)\b[^;]*?\bfrom\s+["'](\.{1,2}/[^"']+)["']""", re.M)


@functools.lru_cache
def module_graph(entry: str) -> tuple[str, ...]:
    """Every ES module `entry` (a /static/… URL) imports, directly or not, in discovery order. A page lists
    them as <link rel="modulepreload"> so the browser fetches them all at once instead of one import
    level per round trip."""
    seen: list[str] = []
    stack = [entry]
    while stack:
        url = stack.pop()
        path = STATIC / url.removeprefix("/static/")
        if not path.is_file():
            continue
        for relative in _IMPORT.findall(path.read_text(encoding="utf-8")):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(url), relative))
            if target not in seen and target != entry:
                seen.append(target)
                stack.append(target)
    return tuple(seen)


templates.env.globals["module_graph"] = module_graph
