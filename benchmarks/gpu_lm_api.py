"""The LM's fresh first view through the API against a raw forward, on a device (scripts/gpu_check.sh step 4):
the bench's LM first-view measure (benchmarks/run_all.py) without the section's Chromium parts.

    python -m benchmarks.gpu_lm_api --device cuda --port 8124 --repeats 7 --out lm_api.md    # from the checkout's root
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import benchmarks.run_all as bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    bench.DEVICE = bench.resolve_device(args.device)
    server = bench.Server(args.port)
    try:
        rows = bench.bench_lm_first_view(server, bench.RawLM(), args.repeats)
    finally:
        server.stop()
    lines = ["| tokens | raw forward ms | fresh first view ms | ratio | server: model ms | server: whole request ms | "
             "server fixed cost ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['raw_ms']:.1f} | {r['fresh_ms']:.1f} | {r['fresh_ratio']:.2f}× | "
                     f"{r['server_model_ms']:.1f} | {r['server_app_ms']:.1f} | "
                     f"{r['server_app_ms'] - r['server_model_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
