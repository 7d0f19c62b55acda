"""A trace restricted to a seeded random subset of its pools: the market a user sees who allows
only some zones (data residency, quota, a region's network). Real prices and counts, a market
no policy was tuned on. Plain script:

    python scripts/zone_subset.py airflow_provider_spotsched/data/traces/gcp_h100_13zones_2025-10.csv.gz \
        --pools 5 --seed 1 --out gcp-sub1.csv.gz

The pools are drawn with ``random.Random(1000 * seed + the trace's pool count)`` and printed.
"""

from __future__ import annotations

import argparse
import gzip
import random
from pathlib import Path


def subset(lines: list[str], pools: int, seed: int) -> tuple[list[str], list[str]]:
    """The header and the rows of ``pools`` pools drawn with ``seed``, and the pools drawn."""
    header, rows = lines[0], lines[1:]
    names = [name.strip() for name in header.split(",")]
    if "market" not in names:
        raise SystemExit(f"the header {header!r} has no 'market' column; is this a trace in the spec's format?")
    column = names.index("market")  # the spec fixes the columns, not their order
    every = sorted({row.split(",")[column] for row in rows})
    if not 1 <= pools <= len(every):
        raise SystemExit(f"--pools {pools}: the trace has {len(every)} pools; give 1 to {len(every)}")
    kept = set(random.Random(1000 * seed + len(every)).sample(every, pools))
    return [header, *(row for row in rows if row.split(",")[column] in kept)], sorted(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="trace file (.csv or .csv.gz)")
    parser.add_argument("--pools", type=int, required=True, help="how many pools to keep")
    parser.add_argument("--seed", type=int, default=1, help="which pools (the same seed, the same pools)")
    parser.add_argument("--out", required=True, help="trace file to write (.csv or .csv.gz)")
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as handle:
        lines = handle.read().splitlines()
    kept_lines, kept = subset(lines, args.pools, args.seed)
    text = "\n".join(kept_lines) + "\n"
    out = Path(args.out)
    if out.name.endswith(".gz"):
        with gzip.open(out, "wt") as handle:
            handle.write(text)
    else:
        out.write_text(text)
    print(f"{out}: {', '.join(kept)}")


if __name__ == "__main__":
    main()
