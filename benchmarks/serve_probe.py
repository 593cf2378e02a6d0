"""The app under uvicorn for the bench, as `python -m uvicorn app.main:app` serves it, plus one thing the app
does not expose: once a second the result cache's size (items, bytes) is written to the file named by
ATTNLAB_BENCH_CACHE_FILE, which benchmarks/run_all.py reads while it samples the process's RSS.

    python benchmarks/serve_probe.py PORT
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import uvicorn

from app.main import app  # the installed attnlab (pip install -e .)


def write_cache_size(path: Path) -> None:
    while True:
        runtime = getattr(app.state, "runtime", None)
        cache = getattr(runtime, "cache", None)
        if cache is not None:
            line = {"time": time.time(), "items": len(getattr(cache, "_items", ())), "bytes": getattr(cache, "_bytes", None),
                    "max_bytes": cache.max_bytes, "hits": cache.hits, "misses": cache.misses}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(line))
            tmp.replace(path)  # the reader never sees half a line
        time.sleep(1)


if __name__ == "__main__":
    target = os.environ.get("ATTNLAB_BENCH_CACHE_FILE")
    if target:
        threading.Thread(target=write_cache_size, args=(Path(target),), name="bench-cache-size", daemon=True).start()
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
