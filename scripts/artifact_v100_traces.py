"""Two more real spot markets, from the SkyNomad artifact: AWS V100 capacity counted per zone.

The artifact (andylizf/skynomad-artifact, Apache-2.0) holds, besides the 0/1 availability our
shipped AWS trace comes from, two captures that count how many of several requested p3.2xlarge
instances each zone granted, every 300 s:

- ``data/spot_hedge_4node_src``: four requested, three zones (us-east-1f, us-east-2a,
  us-west-2c), 3156 ticks (263 h), the three series aligned (the capture the artifact's own
  ``convert_v100_4node_600s.py`` builds its four-node cell from);
- ``data/v100_multinode_raw/16-nodes``: sixteen requested; us-west-2a and us-west-2c have 4736
  ticks each (395 h). us-east-2b's series is shorter (3247 ticks) and cannot be aligned with
  them, so it is left out.

The captures carry no prices and no timestamps. Each zone gets one constant spot price, the
mean of its series in ``data/v100_spot_prices.json`` (as the artifact's converter does by
default), on-demand 3.06 USD an hour (p3.2xlarge); the ticks start at ``--start``, a nominal
time. For each zone it prints how often the zone is empty and how often its count changes.
Neither market has been used to choose anything in this project. Plain script:

    python scripts/artifact_v100_traces.py --artifact <checkout of andylizf/skynomad-artifact> --out-dir results/artifact
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

ON_DEMAND_PRICE = 3.06  # p3.2xlarge, USD an hour (the artifact's ACTUAL_COSTS['v100_1'])
TICK_SECONDS = 300
MARKETS = {
    "aws_v100_4node_3az": ("data/spot_hedge_4node_src", ("us-east-1f", "us-east-2a", "us-west-2c")),
    "aws_v100_16node_2az": ("data/v100_multinode_raw/16-nodes", ("us-west-2a", "us-west-2c")),
}


def zone_counts(artifact: Path, folder: str, zone: str) -> list[int]:
    """The zone's granted-instance counts, one per tick."""
    return [int(count) for count in json.loads((artifact / folder / f"{zone}_v100_1.json").read_text())["data"]]


def describe_zone(zone: str, counts: list[int], price: float) -> str:
    """One line on a zone's capacity: how often it is empty and how often its count changes."""
    days = len(counts) * TICK_SECONDS / 86400
    changes = sum(1 for before, after in zip(counts, counts[1:]) if before != after)
    empty = sum(1 for count in counts if count == 0) / len(counts)
    return (
        f"  {zone}: {len(counts) * TICK_SECONDS / 3600:.0f} h, counts 0-{max(counts)}, empty {empty:.0%} of the time, "
        f"{changes / days:.1f} count changes a day, spot {price:.4f} USD/h"
    )


def write_market(artifact: Path, name: str, out_dir: Path, start: datetime) -> Path:
    """Write one market as a trace file of the spec's format, and print each zone's line."""
    folder, zones = MARKETS[name]
    counts = {zone: zone_counts(artifact, folder, zone) for zone in zones}
    lengths = {len(series) for series in counts.values()}
    if len(lengths) != 1:
        raise SystemExit(f"{name}: the zones' series differ in length {sorted(lengths)}; they cannot be aligned")
    price_series = json.loads((artifact / "data/v100_spot_prices.json").read_text())
    prices = {zone: sum(price_series[f"{zone}_v100_1"]) / len(price_series[f"{zone}_v100_1"]) for zone in zones}
    for zone in zones:
        print(describe_zone(zone, counts[zone], prices[zone]))
    path = out_dir / f"{name}.csv.gz"
    with gzip.open(path, "wt", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["timestamp", "market", "spot_price", "available", "on_demand_price"])
        for tick in range(lengths.pop()):
            stamp = (start + timedelta(seconds=TICK_SECONDS * tick)).strftime("%Y-%m-%dT%H:%M:%SZ")
            for zone in zones:
                writer.writerow([stamp, zone, f"{prices[zone]:.4f}", counts[zone][tick], f"{ON_DEMAND_PRICE:.4f}"])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True, help="a checkout of andylizf/skynomad-artifact")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the trace files go")
    parser.add_argument(
        "--start",
        type=lambda text: datetime.fromisoformat(text.replace("Z", "+00:00")),
        default=datetime(2023, 8, 1, tzinfo=timezone.utc),
        help="the first tick's time (nominal: the captures carry none)",
    )
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in MARKETS:
        print(write_market(args.artifact, name, args.out_dir, args.start))


if __name__ == "__main__":
    main()
