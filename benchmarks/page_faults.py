"""What first-touching new memory costs on this machine: 8 MB tensors (a 128-token minilm run keeps ~8.5 MB: P,
q̂/k̂, hidden states) allocated, written once and kept, 25 at a time, up to `--mb` MB; the wall time of each 8 MB and
the minor page faults it took. On a VM whose host backs guest memory lazily and takes freed memory back (free page
reporting, a balloon), a page the guest has not used lately costs a trip to the host: on the shared 2-core CI machine
8 MB took 2.6-3.1 ms up to ~800 MB and 17-28 ms beyond (8-12 µs a page), and a first touch of 19 GB made it fast
again for ~15 minutes (benchmarks/results/first_view.md). A served fresh view pays this for the run it keeps while
the result cache grows, and the disk tier's writer for the page cache of each run it spills.

    python -m benchmarks.page_faults [--mb 1600]
"""
from __future__ import annotations

import argparse
import resource
import time

import torch

CHUNK_FLOATS = 2 * 2**20  # 8 MB of float32
BATCH = 25  # chunks a line: 200 MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=1600, help="new memory to touch in all (MB)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kept = []
    for batch in range(max(1, args.mb // (8 * BATCH))):
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        for _ in range(BATCH):
            chunk = torch.empty(CHUNK_FLOATS)
            chunk.fill_(1.0)  # the first write faults every page in
            kept.append(chunk)
        ms = (time.perf_counter() - start) * 1000 / BATCH
        pages = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / BATCH
        print(f"{(batch + 1) * 8 * BATCH:>6,} MB kept: {ms:6.2f} ms per 8 MB, {pages:,.0f} page faults "
              f"({ms * 1000 / max(pages, 1):.1f} µs a page)", flush=True)


if __name__ == "__main__":
    main()
