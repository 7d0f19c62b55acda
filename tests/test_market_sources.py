"""Market sources: trace replay, the availability rules, AWS (moto server, recorded pages) and GCP
(recorded Billing Catalog pages). Cloud prices here are fake: the tests check requests, paging,
filters and parsing, and the arithmetic on the recorded numbers."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import boto3
import numpy as np
import pytest
import requests
import responses
from botocore.stub import Stubber
from responses import matchers

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.market.availability import (
    AvailabilitySignal,
    SignalKind,
    available_at,
    outcome_signal,
    score_to_count,
)
from airflow_provider_spotsched.market.aws import AwsSpotMarketSource
from airflow_provider_spotsched.market.gcp import CATALOG_URL, CatalogError, GcpSpotMarketSource, MachineShape
from airflow_provider_spotsched.market.history import MarketHistoryStore
from airflow_provider_spotsched.market.launch import LaunchOutcome
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.market.source import CombinedMarketSource, TraceFileSource
from airflow_provider_spotsched.market.trace import TraceError
from tests.moto_server import aws_env, moto_endpoint  # noqa: F401  (pytest fixtures)

UTC = timezone.utc
T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
BILLING = Path(__file__).parent / "data" / "gcp_billing"


def minutes(series, origin: datetime = T0) -> list[float]:
    return list((series.times - origin.timestamp()) / 60)


# ----- trace files


def test_a_trace_file_replays_the_ticks_of_the_window(gcp_trace):
    source = TraceFileSource(GCP_TRACE)
    start = datetime(2025, 10, 5, 0, 0, tzinfo=UTC)
    window = source.observe(start, start + timedelta(minutes=30))
    assert window.names == gcp_trace.names
    pool = window.pools["us-central1-a"]
    assert minutes(pool, start) == [0, 10, 20, 30]  # both ends included
    full = gcp_trace.pools["us-central1-a"]
    first = int(np.searchsorted(full.times, start.timestamp()))
    np.testing.assert_array_equal(pool.available, full.available[first : first + 4])
    # what comes out resamples like the shipped trace
    market = resample(window, start, slot_hours=0.25, num_slots=2)
    assert market.num_slots == 2 and market.pools == tuple(gcp_trace.names)
    assert source.observe(datetime(2020, 1, 1, tzinfo=UTC), datetime(2020, 1, 2, tzinfo=UTC)).pools == {}


def test_any_csv_trace_file_is_a_source_and_sources_combine_disjoint_pools(tmp_path):
    rows = ["timestamp,market,spot_price,available,on_demand_price"]
    zones = ("us-east-1a", "us-east-2a")
    rows += [f"2023-03-01T00:{m:02d}:00Z,{zone},1.0,1,3.06" for m in (0, 5, 10) for zone in zones]
    aws_file, gcp_file = tmp_path / "aws.csv", tmp_path / "gcp.csv"
    aws_file.write_text("\n".join(rows) + "\n")
    renamed = (r.replace("us-east-1a", "us-central1-a").replace("us-east-2a", "europe-west1-c") for r in rows)
    gcp_file.write_text("\n".join(renamed) + "\n")
    source = TraceFileSource(aws_file)
    start = datetime(2023, 3, 1, tzinfo=UTC)
    with pytest.raises(ValueError, match="start .* must be a timezone-aware datetime"):
        source.observe(datetime(2023, 3, 1), start)
    with pytest.raises(ValueError, match="is before start"):
        source.observe(start + timedelta(hours=1), start)
    inside = source.observe(start + timedelta(minutes=1), start + timedelta(minutes=5))
    assert minutes(inside.pools["us-east-2a"], start) == [5]
    both = CombinedMarketSource([source, TraceFileSource(gcp_file)]).observe(start, start + timedelta(hours=1))
    assert both.names == ["europe-west1-c", "us-central1-a", "us-east-1a", "us-east-2a"]
    with pytest.raises(TraceError, match="come from two sources"):
        CombinedMarketSource([source, source]).observe(start, start + timedelta(hours=1))


# ----- availability rules


def test_scores_map_linearly_onto_the_target_count():
    assert [score_to_count(s, 1) for s in range(1, 11)] == [0] * 5 + [1] * 5
    assert score_to_count(1, 8) == 0 and score_to_count(10, 8) == 8 and score_to_count(5, 9) == 4
    with pytest.raises(ValueError, match="must be an integer in 1..10"):
        score_to_count(0, 1)


def test_latest_evidence_wins_and_a_success_only_raises_the_estimate():
    at = lambda m: T0 + timedelta(minutes=m)  # noqa: E731
    signals = [
        AvailabilitySignal(at(0), "p", 4, SignalKind.SCORE),
        outcome_signal(LaunchOutcome(at(10), "p", 4, 0, "InsufficientInstanceCapacity")),
        outcome_signal(LaunchOutcome(at(20), "p", 2, 2)),
        AvailabilitySignal(at(30), "p", 1, SignalKind.SCORE),
        outcome_signal(LaunchOutcome(at(40), "p", 3, 3)),
    ]
    ttl = timedelta(hours=1)
    estimates = [available_at(signals, at(m), ttl) for m in (-1, 0, 10, 20, 30, 40, 65, 99, 100)]
    # before any: unknown; score 4; shortfall 0; success 2 raises; score 1; success 3; the 10-min
    # shortfall has expired at 70 but the score 1 (30) and success 3 (40) remain; all gone at 100
    assert estimates == [None, 4, 0, 2, 1, 3, 3, 3, None]
    with pytest.raises(ValueError, match="launched 5 must lie in 0..requested"):
        outcome_signal(LaunchOutcome(T0, "p", 2, 5))


# ----- AWS against the moto server


def recording(client) -> list[tuple[str, dict]]:
    """Every API call the client makes, with its parameters, as botocore is about to send it."""
    calls: list[tuple[str, dict]] = []
    client.meta.events.register(
        "provide-client-params.ec2.*", lambda params, model, **_: calls.append((model.name, dict(params)))
    )
    return calls


def test_aws_asks_the_price_history_per_zone_type_and_product_and_reads_outcomes(aws_env):
    ec2 = boto3.client("ec2", endpoint_url=aws_env, region_name="us-east-1")
    calls = recording(ec2)
    outcomes = [
        LaunchOutcome(T0 + timedelta(minutes=5), "us-east-1a", 2, 2),
        LaunchOutcome(T0 + timedelta(minutes=25), "us-east-1c", 2, 0, "InsufficientInstanceCapacity"),
        LaunchOutcome(T0 + timedelta(minutes=25), "us-west-2a", 1, 0, "InsufficientInstanceCapacity"),
    ]
    asked = []
    source = AwsSpotMarketSource(
        ec2, "g4dn.xlarge", ["us-east-1a", "us-east-1c"], on_demand_price=0.526, placement_target=None,
        launch_outcomes=lambda a, b: asked.append((a, b)) or outcomes,
    )
    trace = source.observe(T0, T0 + timedelta(hours=1))
    assert calls == [(
        "DescribeSpotPriceHistory",
        {
            "StartTime": T0, "EndTime": T0 + timedelta(hours=1), "InstanceTypes": ["g4dn.xlarge"],
            "ProductDescriptions": ["Linux/UNIX"],
            "Filters": [{"Name": "availability-zone", "Values": ["us-east-1a", "us-east-1c"]}],
        },
    )]
    assert asked == [(T0 - timedelta(hours=1), T0 + timedelta(hours=1))]  # outcomes still in force count
    assert trace.names == ["us-east-1a", "us-east-1c"]  # the us-west-2a outcome is not this source's
    zone_a, zone_c = trace.pools["us-east-1a"], trace.pools["us-east-1c"]
    # ticks on the 10-minute grid and at each outcome, from the first evidence on
    assert minutes(zone_a) == [5, 10, 20, 30, 40, 50, 60] and list(zone_a.available) == [2] * 7
    assert minutes(zone_c) == [25, 30, 40, 50, 60] and list(zone_c.available) == [0] * 5
    # moto's one (fake, 2006-stamped) record per zone is the price in force at the window's start
    assert set(zone_a.spot_price) == {0.00001} and set(zone_a.on_demand_price) == {0.526}


def test_aws_price_history_follows_every_page():
    """moto answers in a single page, so the paging is checked on recorded multi-page replies."""
    ec2 = boto3.client("ec2", region_name="us-east-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    stub = Stubber(ec2)
    base = {
        "StartTime": T0, "EndTime": T0 + timedelta(hours=2), "InstanceTypes": ["p3.2xlarge"],
        "ProductDescriptions": ["Linux/UNIX"],
        "Filters": [{"Name": "availability-zone", "Values": ["us-east-2a", "us-east-2b"]}],
    }

    def record(zone, minute, price, product="Linux/UNIX"):
        return {"AvailabilityZone": zone, "InstanceType": "p3.2xlarge", "ProductDescription": product,
                "SpotPrice": f"{price:.6f}", "Timestamp": T0 + timedelta(minutes=minute)}

    stub.add_response("describe_spot_price_history", {
        "SpotPriceHistory": [record("us-east-2a", 70, 1.2), record("us-east-2b", -300, 0.95)], "NextToken": "page-2",
    }, base)
    stub.add_response("describe_spot_price_history", {
        "SpotPriceHistory": [record("us-east-2a", 30, 1.1), record("us-east-2a", -20, 1.0),
                             record("us-east-2a", -90, 0.9),
                             record("us-east-2a", 40, 9.9, product="Windows")],
        "NextToken": "page-3",
    }, {**base, "NextToken": "page-2"})
    stub.add_response("describe_spot_price_history", {
        "SpotPriceHistory": [record("us-east-2b", 100, 1.05)], "NextToken": "",
    }, {**base, "NextToken": "page-3"})
    source = AwsSpotMarketSource(ec2, "p3.2xlarge", ["us-east-2a", "us-east-2b"], 3.06, placement_target=None)
    with stub:
        changes = source.price_changes(T0, T0 + timedelta(hours=2))
    stub.assert_no_pending_responses()
    start = T0.timestamp()
    # the newest record before the window moves to its start; Windows prices are left out
    assert changes == {
        "us-east-2a": [(start, 1.0), (start + 30 * 60, 1.1), (start + 70 * 60, 1.2)],
        "us-east-2b": [(start, 0.95), (start + 100 * 60, 1.05)],
    }


def test_aws_placement_scores_are_mapped_through_zone_ids():
    """moto 5.2 does not implement GetSpotPlacementScores: recorded replies (two pages) instead."""
    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    now = T0 + timedelta(minutes=33, seconds=20, microseconds=5)
    stub = Stubber(ec2)
    stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [
        {"AvailabilityZone": z, "InstanceType": "p3.2xlarge", "ProductDescription": "Linux/UNIX",
         "SpotPrice": "0.918000", "Timestamp": T0 - timedelta(days=1)} for z in ("us-east-1a", "us-east-1d")
    ]})
    scores = {"InstanceTypes": ["p3.2xlarge"], "TargetCapacity": 4, "TargetCapacityUnitType": "units",
              "SingleAvailabilityZone": True, "RegionNames": ["us-east-1"]}
    # scores name zone ids, which differ per account: the source asks for its zones' ids first
    stub.add_response("describe_availability_zones", {"AvailabilityZones": [
        {"ZoneName": "us-east-1a", "ZoneId": "use1-az6"}, {"ZoneName": "us-east-1d", "ZoneId": "use1-az4"},
    ]}, {"ZoneNames": ["us-east-1a", "us-east-1d"]})
    stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
        {"Region": "us-east-1", "AvailabilityZoneId": "use1-az6", "Score": 10},
        {"Region": "us-east-1", "AvailabilityZoneId": "use1-az1", "Score": 9},  # a zone not asked for
    ], "NextToken": "more"}, scores)
    stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
        {"Region": "us-east-1", "AvailabilityZoneId": "use1-az4", "Score": 3},
    ]}, {**scores, "NextToken": "more"})
    source = AwsSpotMarketSource(
        ec2, "p3.2xlarge", ["us-east-1a", "us-east-1d"], 3.06, placement_target=4, clock=lambda: now
    )
    with stub:
        trace = source.observe(T0, T0 + timedelta(hours=1))
    stub.assert_no_pending_responses()
    # one tick each, at the instant of the score (whole seconds; no tick after now): 10 -> all 4,
    # 3 -> round(4*2/9) = 1
    assert minutes(trace.pools["us-east-1a"]) == [33 + 20 / 60]
    assert list(trace.pools["us-east-1a"].available) == [4] and list(trace.pools["us-east-1d"].available) == [1]
    assert list(trace.pools["us-east-1d"].spot_price) == [0.918]


def test_aws_scores_are_not_asked_for_a_window_in_the_past_and_zones_must_be_in_the_region(aws_env):
    ec2 = boto3.client("ec2", endpoint_url=aws_env, region_name="us-east-1")
    calls = recording(ec2)
    source = AwsSpotMarketSource(ec2, "g4dn.xlarge", ["us-east-1a"], 0.526, placement_target=2,
                                 clock=lambda: T0 + timedelta(days=1))
    assert source.observe(T0, T0 + timedelta(hours=1)).pools == {}  # no evidence: no tick
    assert [name for name, _ in calls] == ["DescribeSpotPriceHistory"]
    with pytest.raises(ValueError, match=r"\['us-west-2a'\] are not in the client's region 'us-east-1'"):
        AwsSpotMarketSource(ec2, "g4dn.xlarge", ["us-east-1a", "us-west-2a"], 0.526)


def test_aws_outcomes_from_the_history_store_feed_the_source(aws_env, tmp_path):
    store = MarketHistoryStore(tmp_path)
    store.record_outcome(LaunchOutcome(T0 + timedelta(minutes=1), "us-east-1a", 1, 0, "InsufficientInstanceCapacity"))
    ec2 = boto3.client("ec2", endpoint_url=aws_env, region_name="us-east-1")
    source = AwsSpotMarketSource(ec2, "g4dn.xlarge", ["us-east-1a"], 0.526, placement_target=None,
                                 launch_outcomes=store.outcomes)
    observed = source.observe(T0, T0 + timedelta(minutes=30))
    store.append(observed)
    back = store.window(T0, T0 + timedelta(minutes=30)).pools["us-east-1a"]
    assert minutes(back) == [1, 10, 20, 30] and list(back.available) == [0, 0, 0, 0]


# ----- GCP against recorded Billing Catalog pages


def billing_page(number: int) -> dict:
    return json.loads((BILLING / f"skus_page{number}.json").read_text())


def add_catalog(mock: responses.RequestsMock) -> None:
    """The three recorded pages, each answered only to the request with the right page token."""
    tokens = ["", billing_page(1)["nextPageToken"], billing_page(2)["nextPageToken"]]
    for number, token in enumerate(tokens, start=1):
        params = {"currencyCode": "USD", "pageSize": "5000", **({"pageToken": token} if token else {})}
        mock.get(CATALOG_URL, json=billing_page(number), match=[matchers.query_param_matcher(params)])


def test_gcp_prices_sum_the_machine_parts_over_every_catalog_page():
    with responses.RequestsMock() as mock:
        add_catalog(mock)
        zones = ["us-central1-a", "us-east4-b", "europe-west1-c"]
        source = GcpSpotMarketSource(requests.Session(), "a3-highgpu-1g", zones)
        prices = source.prices()
        assert [c.request.url.split("?")[0] for c in mock.calls] == [CATALOG_URL] * 3
    assert CATALOG_URL == "https://cloudbilling.googleapis.com/v1/services/6F81-5844-456A/skus"
    # 26 vCPU, 234 GiB, 1 H100; Americas SKUs serve us-central1 and us-east4 alike
    assert prices["us-central1"].on_demand == pytest.approx(26 * 0.02291 + 234 * 0.00307 + 9.00166)
    assert prices["us-central1"].spot == pytest.approx(26 * 0.00916 + 234 * 0.00123 + 2.25)
    east, central = prices["us-east4"], prices["us-central1"]
    assert (east.spot, east.on_demand) == (central.spot, central.on_demand)
    assert prices["europe-west1"].spot == pytest.approx(26 * 0.01008 + 234 * 0.00135 + 2.48)
    assert prices["europe-west1"].on_demand == pytest.approx(26 * 0.0252 + 234 * 0.00338 + 9.9)


def test_gcp_ticks_carry_catalog_prices_and_outcome_availability_and_the_catalog_is_read_once():
    outcomes = [
        LaunchOutcome(T0 + timedelta(minutes=2), "us-central1-a", 16, 16),
        LaunchOutcome(T0 + timedelta(minutes=2), "europe-west1-c", 16, 0, "ZONE_RESOURCE_POOL_EXHAUSTED"),
    ]
    with responses.RequestsMock() as mock:
        add_catalog(mock)
        source = GcpSpotMarketSource(requests.Session(), "a3-highgpu-1g", ["us-central1-a", "europe-west1-c"],
                                     launch_outcomes=lambda a, b: outcomes, clock=lambda: T0 + timedelta(minutes=25))
        trace = source.observe(T0, T0 + timedelta(minutes=20))
        again = source.observe(T0, T0 + timedelta(minutes=20))
        assert len(mock.calls) == 3  # the second observe reused the prices
    assert trace.source == "gcp:a3-highgpu-1g" and again.names == trace.names
    central, europe = trace.pools["us-central1-a"], trace.pools["europe-west1-c"]
    assert minutes(central) == [2, 10, 20] and list(central.available) == [16, 16, 16]
    assert list(europe.available) == [0, 0, 0]
    assert central.spot_price[0] == pytest.approx(26 * 0.00916 + 234 * 0.00123 + 2.25)
    assert europe.on_demand_price[0] == pytest.approx(26 * 0.0252 + 234 * 0.00338 + 9.9)


def test_gcp_refuses_unknown_machines_zones_and_missing_skus():
    with pytest.raises(ValueError, match="is not in the table"):
        GcpSpotMarketSource(requests.Session(), "a9-megagpu-1g", ["us-central1-a"])
    with pytest.raises(ValueError, match="is not a GCP zone name"):
        GcpSpotMarketSource(requests.Session(), "a3-highgpu-1g", ["uscentral1"])
    with responses.RequestsMock() as mock:
        add_catalog(mock)
        source = GcpSpotMarketSource(requests.Session(), "a3-highgpu-1g", ["asia-south2-b"])
        missing = "no SKU for 'Spot Preemptible A3 Instance Core running in '.*'asia-south2"
        with pytest.raises(CatalogError, match=missing):
            source.prices()
    # a shape the table lacks is priced from its parts (here: no GPU SKU is needed)
    with responses.RequestsMock() as mock:
        add_catalog(mock)
        cpu_only = GcpSpotMarketSource(requests.Session(), MachineShape("A3", 2, 8), ["us-central1-b"])
        assert cpu_only.prices()["us-central1"].spot == pytest.approx(2 * 0.00916 + 8 * 0.00123)
