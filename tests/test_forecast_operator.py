"""The forecast operator: the ``spotsched forecast`` document, from a trace or a history store."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.cli import main
from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.market.history import MarketHistoryStore
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.market.source import TraceFileSource, clip
from airflow_provider_spotsched.market.trace import TraceError, parse_timestamp
from airflow_provider_spotsched.operators.forecast import SpotMarketForecastOperator

AT = "2025-10-11T04:10:00Z"
POOLS = ["us-east4-a", "europe-west1-c"]
WHOLE_TRACE_HOURS = 24 * 30.0  # more than the GCP trace holds before AT


def cli_document(tmp_path, model: str, at_least: list[int]) -> dict:
    out = tmp_path / "cli.json"
    pools = ["--pools", ",".join(POOLS)]
    extra = ["--at-least", *map(str, at_least)] if at_least else []
    args = ["forecast", "--trace", str(GCP_TRACE), "--at", AT, "--horizon", "6", "--model", model, *pools, *extra]
    assert main([*args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("model", ["seasonal-naive", "markov-count"])
def test_the_document_is_the_one_the_cli_writes(tmp_path, model):
    operator = SpotMarketForecastOperator(
        task_id="forecast", market="gcp", pools=POOLS, at=AT, model=model, horizon=6, at_least=[2, 4],
        history_hours=WHOLE_TRACE_HOURS,
    )
    document = json.loads(json.dumps(operator.execute({})))  # as XCom stores it
    assert document == cli_document(tmp_path, model, [2, 4])
    assert set(document["pools"]["us-east4-a"]["p_available_at_least"]) == {"1", "2", "4"}


def test_seasonal_naive_on_half_hour_slots_copies_the_state_a_day_earlier():
    operator = SpotMarketForecastOperator(task_id="forecast", market="gcp", pools=POOLS, at=AT, model="seasonal-naive",
                                          horizon=8, slot_hours=0.5, history_hours=72.0)
    document = operator.execute({})
    day_before = resample(TraceFileSource(GCP_TRACE).trace, start=parse_timestamp(AT) - timedelta(hours=23.5),
                          slot_hours=0.5, num_slots=8, pools=POOLS)
    for m, pool in enumerate(POOLS):
        assert document["pools"][pool]["available"] == day_before.available[:, m].astype(float).tolist()


def test_at_defaults_to_the_logical_date_and_reads_nothing_after_it(tmp_path):
    operator = SpotMarketForecastOperator(task_id="forecast", market="gcp", pools=POOLS, model="persistence", horizon=3)
    logical = datetime(2025, 10, 11, 4, 10, tzinfo=timezone.utc)
    document = operator.execute({"logical_date": logical})
    assert document["at"] == AT and document["slot_hours"] == 1.0
    assert all(len(pool["spot_price"]) == 3 for pool in document["pools"].values())
    # persistence repeats the state in force at AT: proof that the cut is at AT, not later
    state = clip(TraceFileSource(GCP_TRACE).trace, logical - timedelta(minutes=10), logical)  # the tick at AT
    assert document["pools"]["us-east4-a"]["spot_price"] == [float(state.pools["us-east4-a"].spot_price[-1])] * 3


def test_a_history_store_is_a_market_too(tmp_path):
    """Ticks recorded into a MarketHistoryStore forecast exactly as the trace they came from."""
    spec = MarketSpec("trace", options={"path": "gcp"})
    at = datetime(2025, 10, 11, 4, 10, tzinfo=timezone.utc)
    MarketHistoryStore(tmp_path / "history").append(spec.observe(at - timedelta(days=3), at + timedelta(hours=1)))
    common = dict(pools=POOLS, at=AT, model="seasonal-naive", horizon=4, history_hours=48.0)
    history = {"kind": "history", "options": {"root": str(tmp_path / "history")}}
    from_store = SpotMarketForecastOperator(task_id="a", market=history, **common)
    from_trace = SpotMarketForecastOperator(task_id="b", market="gcp", **common)
    assert from_store.execute({}) == from_trace.execute({})


def test_a_live_market_whose_data_lags_the_clock_is_forecast_with_its_staleness(tmp_path):
    """A history store recorded up to 8 minutes before the logical date (a live feed lags the clock):
    the forecast is made from its newest ticks and says how old they are."""
    spec = MarketSpec("trace", options={"path": "gcp"})
    at = datetime(2025, 10, 11, 4, 10, tzinfo=timezone.utc)
    ticks = clip(spec.observe(at - timedelta(days=3), at), at - timedelta(days=3), at - timedelta(minutes=8))
    MarketHistoryStore(tmp_path / "history").append(ticks)
    history = {"kind": "history", "options": {"root": str(tmp_path / "history")}}
    operator = SpotMarketForecastOperator(task_id="forecast", market=history, pools=POOLS, model="persistence",
                                          horizon=3, history_hours=48.0)
    document = operator.execute({"logical_date": at})
    newest = max(float(series.times[-1]) for series in ticks.pools.values())
    assert document["staleness_seconds"] == pytest.approx(at.timestamp() - newest) and document["staleness_seconds"] >= 480
    for pool in POOLS:
        entry, series = document["pools"][pool], ticks.pools[pool]
        assert entry["available"] == [float(series.available[-1])] * 3 and not entry["stale"]
    strict = SpotMarketForecastOperator(task_id="strict", market=history, pools=POOLS, model="persistence", horizon=3,
                                        history_hours=48.0, max_staleness_hours=0.0)
    with pytest.raises(TraceError, match="staleness"):
        strict.execute({"logical_date": at})


def test_bad_input_is_refused_with_the_field_to_fix():
    with pytest.raises(ValueError, match=r"^model='prophet': not a forecaster of a live market; choose one of \['arima', "):
        SpotMarketForecastOperator(task_id="f", market="gcp", model="prophet")
    with pytest.raises(ValueError, match="horizon must be 1..48"):
        SpotMarketForecastOperator(task_id="f", market="gcp", horizon=100)
    with pytest.raises(ValueError, match="neither a MarketSpec"):
        SpotMarketForecastOperator(task_id="f", market=42)
    with pytest.raises(ValueError, match="needs option"):
        SpotMarketForecastOperator(task_id="f", market={"kind": "aws", "options": {}})
    with pytest.raises(ValueError, match="at 'yesterday' is not an ISO-8601"):
        SpotMarketForecastOperator(task_id="f", market="gcp", at="yesterday").execute({})
    with pytest.raises(TraceError, match="pool"):
        SpotMarketForecastOperator(task_id="f", market="gcp", pools=["mars-1a"], at=AT).execute({})
    for tiny in (1e-9, 0, float("nan")):  # refused when the DAG is parsed, not by running out of memory
        with pytest.raises(ValueError, match="slot_hours="):
            SpotMarketForecastOperator(task_id="f", market="gcp", slot_hours=tiny)


def test_the_oracle_is_refused_when_the_dag_is_parsed():
    """It reads the future, so it cannot forecast a live market: refused naming the field and the choices,
    not when the task runs with the oracle's own 'call reveal(...)'."""
    message = r"^model='oracle': not a forecaster of a live market; choose one of \[.*'sojourn-chain'\]$"
    with pytest.raises(ValueError, match=message) as refusal:
        SpotMarketForecastOperator(task_id="f", market="gcp", model="oracle")
    assert "'oracle'" not in str(refusal.value).split("choose one of")[1]


@pytest.mark.parametrize(("slot_hours", "history_hours", "least"), [(1.0, 12, 24), (0.25, 23.9, 24), (48.0, 24.0, 48)])
def test_less_history_than_a_forecast_needs_is_refused_when_the_dag_is_parsed(slot_hours, history_hours, least):
    """Every run would fail, and the run-time advice (a later at) cannot help: the window moves with at.
    The need is in slots (a day of them, and at least 2), so a slot longer than a day needs more hours."""
    message = rf"^history_hours={history_hours!r}: a forecast needs .* give history_hours >= {least}$"
    with pytest.raises(ValueError, match=message):
        SpotMarketForecastOperator(task_id="f", market="gcp", slot_hours=slot_hours, history_hours=history_hours)


def hourly_trace(path, hours: dict[str, int] | None = None):
    """Pools ticking on the hour from 2025-01-01 for so many hours (default pool a for 3 days)."""
    start = datetime(2025, 1, 1, tzinfo=timezone.utc)
    rows = [f"{(start + timedelta(hours=h)).strftime('%Y-%m-%dT%H:%M:%SZ')},{pool},1.0,4,5.0"
            for h in range(72) for pool, until in (hours or {"a": 72}).items() if h < until]
    path.write_text("timestamp,market,spot_price,available,on_demand_price\n" + "\n".join(rows) + "\n")
    return str(path)


def test_a_window_too_short_at_run_time_names_history_hours_not_a_later_at(tmp_path):
    """Quarter-hour slots of an hourly feed: 24 h before 12:30 start at the 13:00 tick, 95 slots of the 96
    needed. A later at moves the window along; what helps is more history_hours. A market that starts
    too late for at still gets the advice of a later at."""
    trace = hourly_trace(tmp_path / "hourly.csv")
    common = dict(market=trace, slot_hours=0.25, model="persistence", horizon=2)
    short = SpotMarketForecastOperator(task_id="f", at="2025-01-03T12:30:00Z", history_hours=24.0, **common)
    message = r"^history_hours=24 leaves 95 slot\(s\) .*needs at least 96 .*raise history_hours by at least 0.25$"
    with pytest.raises(TraceError, match=message):
        short.execute({})
    assert SpotMarketForecastOperator(task_id="f", at="2025-01-03T12:30:00Z", history_hours=25.0, **common).execute({})
    early = SpotMarketForecastOperator(task_id="f", at="2025-01-01T12:30:00Z", history_hours=72.0, **common)
    with pytest.raises(TraceError, match=r"leaves 51 slot\(s\) .*choose an --at at or after 2025-01-01T23:45:00Z$"):
        early.execute({})


def test_a_pool_without_ticks_in_the_window_is_refused_as_such_not_as_unknown(tmp_path):
    """Pool gone ticked on day 1 only. The 36 h before day 3's 23:00 hold none of its ticks: the window
    cannot say how old its last one is, so it is refused naming history_hours, not called unknown.
    A window that reaches its last tick forecasts it as stale, as the CLI does on the whole trace."""
    trace = hourly_trace(tmp_path / "gaps.csv", {"a": 72, "gone": 24})
    common = dict(market=trace, pools=["a", "gone"], at="2025-01-03T23:00:00Z", model="persistence", horizon=2)
    message = (r"^pools=\['gone'\]: no tick in the 36 h before at 2025-01-03T23:00:00Z \(history_hours\) in .*gaps.csv, "
               r"whose pools with ticks then are \['a'\]; raise history_hours, or check the feed and the pool names$")
    with pytest.raises(TraceError, match=message):
        SpotMarketForecastOperator(task_id="f", history_hours=36.0, **common).execute({})
    document = SpotMarketForecastOperator(task_id="f", history_hours=72.0, **common).execute({})
    assert document["pools"]["gone"]["stale"] and document["pools"]["gone"]["available"] == [0.0, 0.0]


@pytest.mark.parametrize("pools", ["us-east4-a,europe-west1-c", "us-east4-a"])
def test_pools_rendered_to_one_string_are_read_comma_separated(pools):
    """pools is templated, so it renders to text: "us-east4-a" is one pool, not ten letters."""
    operator = SpotMarketForecastOperator(task_id="forecast", market="gcp", pools=pools, at=AT, model="persistence", horizon=2)
    assert list(operator.execute({})["pools"]) == pools.split(",")
