"""scripts/artifact_v100_traces.py: the artifact's count captures become trace files the project reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from airflow_provider_spotsched.market.trace import load_trace

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "artifact_v100_traces.py"
FOUR_NODE = {"us-east-1f": [0, 4, 3], "us-east-2a": [4, 4, 0], "us-west-2c": [1, 2, 4]}
SIXTEEN_NODE = {"us-west-2a": [16, 0, 7, 7], "us-west-2c": [3, 16, 16, 0]}
PRICES = {"us-east-1f": [1.2, 1.4], "us-east-2a": [0.9, 0.9], "us-west-2c": [0.95, 0.93], "us-west-2a": [1.0, 0.92]}


def _artifact(root: Path, sixteen_node: dict[str, list[int]]) -> Path:
    """A checkout of the artifact holding only what the script reads."""
    for folder, zones in (("spot_hedge_4node_src", FOUR_NODE), ("v100_multinode_raw/16-nodes", sixteen_node)):
        (root / "data" / folder).mkdir(parents=True)
        for zone, counts in zones.items():
            (root / "data" / folder / f"{zone}_v100_1.json").write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": counts}))
    (root / "data" / "v100_spot_prices.json").write_text(json.dumps({f"{zone}_v100_1": series for zone, series in PRICES.items()}))
    return root


def _run(artifact: Path, out_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--artifact", str(artifact), "--out-dir", str(out_dir), "--start", "2023-08-01T00:00:00Z"],
        capture_output=True,
        text=True,
        check=False,
    )


def test_each_zone_keeps_its_counts_every_300_s_at_its_mean_price_and_is_described(tmp_path: Path) -> None:
    result = _run(_artifact(tmp_path / "artifact", SIXTEEN_NODE), tmp_path / "out")
    assert result.returncode == 0, result.stderr
    for name, zones in (("aws_v100_4node_3az", FOUR_NODE), ("aws_v100_16node_2az", SIXTEEN_NODE)):
        trace = load_trace(tmp_path / "out" / f"{name}.csv.gz")
        assert trace.names == sorted(zones)
        for zone, counts in zones.items():
            pool = trace.pools[zone]
            assert pool.available.tolist() == counts
            assert np.allclose(np.diff(pool.times), 300)
            assert np.allclose(pool.spot_price, np.mean(PRICES[zone]), atol=1e-4)
            assert np.allclose(pool.on_demand_price, 3.06)
        assert trace.first_time == 1690848000  # 2023-08-01T00:00:00Z
    # 2 changes over 3 ticks of 300 s (1/96 day); the mean of [1.2, 1.4]
    assert "us-east-1f: 0 h, counts 0-4, empty 33% of the time, 192.0 count changes a day, spot 1.3000 USD/h" in result.stdout


def test_zones_whose_series_differ_in_length_are_refused(tmp_path: Path) -> None:
    result = _run(_artifact(tmp_path / "artifact", {"us-west-2a": [16, 0], "us-west-2c": [3, 16, 16]}), tmp_path / "out")
    assert result.returncode != 0
    assert "aws_v100_16node_2az: the zones' series differ in length [2, 3]" in result.stderr
