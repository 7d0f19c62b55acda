"""The seeded synthetic markets: reproducible, in the spec's format, with the behaviours they promise."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from airflow_provider_spotsched.cli import main
from airflow_provider_spotsched.market.drops import DROP_FEATURES, FEATURE_HISTORY, drop_after_drop, drop_cases, drop_rates, falls_below
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.market.synthetic import SyntheticMarketConfig, generate, write_trace
from airflow_provider_spotsched.market.trace import load_trace


def test_the_same_seed_writes_the_same_file_and_another_seed_another(tmp_path):
    config = SyntheticMarketConfig(seed=3, days=3)
    first = write_trace(generate(config), tmp_path / "a.csv")
    again = write_trace(generate(config), tmp_path / "b.csv")
    other = write_trace(generate(SyntheticMarketConfig(seed=4, days=3)), tmp_path / "c.csv")
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()


def test_a_generated_trace_loads_and_resamples_as_the_spec_says(tmp_path):
    config = SyntheticMarketConfig(seed=1, pools=4, days=2, tick_minutes=15)
    trace = load_trace(write_trace(generate(config), tmp_path / "m.csv.gz"))
    market = resample(trace, slot_hours=1.0)
    assert market.pools == tuple(config.pool_names) and market.num_slots == 48
    assert market.on_demand_price == config.on_demand_price
    assert (market.available >= 0).all() and (market.available <= config.capacity).all()
    assert (market.spot_price > 0).all() and (market.spot_price < config.on_demand_price).all()


def test_a_collapse_empties_every_pool_for_its_whole_window():
    market = generate(SyntheticMarketConfig(seed=2, days=14, collapses_per_week=2.0))
    assert market.collapses, "two a week over two weeks: some collapse happens"
    for first, end in market.collapses:
        assert (market.available[first:end] == 0).all()
    assert (market.available > 0).any(axis=1).mean() > 0.5, "outside collapses capacity is there most of the time"


def test_without_regimes_or_collapses_capacity_is_always_plentiful():
    config = SyntheticMarketConfig(seed=5, days=3, regimes=False, collapses_per_week=0.0)
    assert (generate(config).available == config.capacity).all()


def test_regimes_switch_with_hour_scale_persistence():
    market = generate(SyntheticMarketConfig(seed=6, days=14, collapses_per_week=0.0, shock_rate_per_day=0.0))
    hourly = market.available[::6]
    changes = (np.diff(hourly, axis=0) != 0).mean()
    assert 0.02 < changes < 0.5, f"a pool's capacity changes in {changes:.0%} of hours: neither frozen nor noise"
    assert len({int(n) for n in np.unique(market.available)}) >= 3, "plenty, scarce and none all occur"


def test_prices_follow_a_daily_cycle():
    config = SyntheticMarketConfig(seed=7, days=14, diurnal_amplitude=0.3, regimes=False, collapses_per_week=0.0)
    price = generate(config).spot_price[::6, 0]  # hourly, one pool
    centred = price - price.mean()
    day = np.corrcoef(centred[:-24], centred[24:])[0, 1]
    half = np.corrcoef(centred[:-12], centred[12:])[0, 1]
    assert day > 0.8 and half < -0.5


def assert_only_counts_lowered(changed, plain):
    """``changed`` is ``plain``'s market with some counts lowered and nothing else touched."""
    np.testing.assert_array_equal(changed.spot_price, plain.spot_price)
    assert changed.collapses == plain.collapses
    assert (changed.available <= plain.available).all() and (changed.available < plain.available).any()


def test_flapping_lowers_counts_in_bursts_and_leaves_the_rest_of_the_seed_alone():
    plain = generate(SyntheticMarketConfig(seed=8, days=14))
    flapping = generate(SyntheticMarketConfig(seed=8, days=14, flap_episodes_per_day=1.0))
    assert_only_counts_lowered(flapping, plain)

    bursty = drop_after_drop(flapping.available[::6])  # hourly, as in the shipped traces' check
    assert bursty[0] > 1.3 * bursty[1]
    memoryless = drop_after_drop(plain.available[::6])
    assert memoryless[0] < memoryless[1]


def test_crunches_spread_from_pool_to_pool_and_leave_the_rest_of_the_seed_alone():
    plain = generate(SyntheticMarketConfig(seed=8, days=14))
    crunched = generate(SyntheticMarketConfig(seed=8, days=14, crunches_per_day=4.0))
    assert_only_counts_lowered(crunched, plain)

    def warned(available):  # P(a pool drops next hour | another dropped this hour), P(... | none did)
        features, dropped = drop_cases(available[::6])  # hourly
        others = features[:, DROP_FEATURES.index("share of the other pools that dropped this slot")] > 0
        return dropped[others].mean(), dropped[~others].mean()

    after_other, after_none = warned(crunched.available)
    assert after_other > 1.5 * after_none  # one pool's drop warns of another's
    after_other, after_none = warned(plain.available)
    assert after_other < 1.2 * after_none  # shocks and collapses hit every pool in the same hour


def test_daily_availability_dips_when_the_price_peaks_and_leaves_the_rest_of_the_seed_alone():
    plain = generate(SyntheticMarketConfig(seed=8, days=14))
    daily = generate(SyntheticMarketConfig(seed=8, days=14, daily_availability=0.5))
    assert_only_counts_lowered(daily, plain)

    # Per pool, the hourly counts kept where capacity is plentiful: at the hour of the day its
    # price peaks about half of them, at the hour it is cheapest all.
    hourly_price, hourly_plain, hourly_daily = daily.spot_price[::6], plain.available[::6], daily.available[::6]
    for m in range(daily.config.pools):
        by_hour = hourly_price[:, m].reshape(-1, 24).mean(axis=0)
        peak, trough = int(by_hour.argmax()), int(by_hour.argmin())
        full = hourly_plain[:, m] == daily.config.capacity
        kept = hourly_daily[:, m][full].astype(float) / daily.config.capacity
        hour = np.flatnonzero(full) % 24
        assert kept[hour == peak].mean() == pytest.approx(0.5, abs=0.1)
        assert kept[hour == trough].mean() == pytest.approx(1.0, abs=0.1)


def test_zones_of_a_region_share_its_first_zones_price_and_leave_the_rest_of_the_seed_alone():
    plain = generate(SyntheticMarketConfig(seed=8, days=14, pools=6))
    regions = generate(SyntheticMarketConfig(seed=8, days=14, pools=6, zones_per_region=3))
    np.testing.assert_array_equal(regions.available, plain.available)
    assert regions.collapses == plain.collapses
    np.testing.assert_array_equal(regions.spot_price[:, [0, 3]], plain.spot_price[:, [0, 3]])  # each region's first zone
    for first, zone in ((0, 1), (0, 2), (3, 4), (3, 5)):
        # The same price, a tie, while both zones are in the same regime; else the short one costs 40% more.
        ratio = regions.spot_price[:, zone] / regions.spot_price[:, first]
        tie = np.isclose(ratio, 1.0, atol=1e-3)
        assert (tie | np.isclose(ratio, 1.4, rtol=1e-3) | np.isclose(ratio, 1 / 1.4, rtol=1e-3)).all()
        assert tie.mean() > 0.3 and not np.array_equal(regions.spot_price[:, zone], plain.spot_price[:, zone])
    with pytest.raises(ValueError, match=re.escape("zones_per_region=0 (must be a whole number >= 1)")):
        SyntheticMarketConfig(zones_per_region=0)


def test_a_price_trend_moves_every_price_by_its_share_a_week_and_leaves_the_rest_of_the_seed_alone():
    plain = generate(SyntheticMarketConfig(seed=8, days=21))
    falling = generate(SyntheticMarketConfig(seed=8, days=21, price_trend_per_week=-0.2))
    rising = generate(SyntheticMarketConfig(seed=8, days=21, price_trend_per_week=0.2))
    np.testing.assert_array_equal(falling.available, plain.available)
    assert falling.collapses == plain.collapses
    week = 7 * 24 * 6  # ten-minute ticks
    ratio = falling.spot_price / plain.spot_price
    np.testing.assert_allclose(ratio[0], 1.0, atol=1e-3)
    np.testing.assert_allclose(ratio[week], 0.8, rtol=2e-3)
    np.testing.assert_allclose(ratio[2 * week], 0.64, rtol=2e-3)
    # Falling, every pool's last week goes below anything its first week showed: new lows a
    # job's history never had. Rising, prices stop just below on-demand.
    assert (falling.spot_price[-week:].min(axis=0) < 0.8 * falling.spot_price[:week].min(axis=0)).all()
    assert rising.spot_price.max() <= 0.95 * rising.config.on_demand_price
    assert (rising.spot_price[-week:].mean(axis=0) > 1.3 * rising.spot_price[:week].mean(axis=0)).all()
    for bad in (-1.0, 1.5, math.nan):
        with pytest.raises(ValueError, match=re.escape(f"price_trend_per_week={bad!r} (must be in (-1, 1])")):
            SyntheticMarketConfig(price_trend_per_week=bad)


def test_settings_out_of_range_are_refused_by_name_with_their_range():
    with pytest.raises(ValueError, match=r"pools=0 \(must be a whole number, 1 to 26\); diurnal_amplitude=1.5 \(must be in \[0, 1\)\)"):
        SyntheticMarketConfig(pools=0, diurnal_amplitude=1.5)
    for bad, message in (({"seed": -1}, "seed=-1"), ({"days": 0.005}, "days=0.005"), ({"days": math.inf}, "days=inf"),
                         ({"days": 1e6}, "at most 3660 days"), ({"tick_minutes": 0}, "tick_minutes=0"),
                         ({"collapses_per_week": math.inf}, "collapses_per_week=inf (must be in [0, 168])"),
                         ({"crunches_per_day": 1e30}, "crunches_per_day=1e+30"), ({"flap_episodes_per_day": 25}, "in [0, 24]"),
                         ({"pools": 2.5}, "pools=2.5"), ({"capacity": 2.5}, "capacity=2.5"), ({"crunch_hours": 1.5}, "crunch_hours")):
        with pytest.raises(ValueError, match=re.escape(message)):
            SyntheticMarketConfig(**bad)


def test_spotsched_synth_writes_a_trace_file_and_refuses_bad_settings(tmp_path, capsys):
    out = tmp_path / "syn.csv.gz"
    assert main(["synth", "--out", str(out), "--seed", "9", "--pools", "3", "--days", "4"]) == 0
    assert "3 pools, 4 days" in capsys.readouterr().out
    assert sorted(load_trace(out).pools) == ["syn-a", "syn-b", "syn-c"]
    assert main(["synth", "--out", str(out), "--pools", "40"]) == 2
    assert main(["synth", "--out", str(out), "--flap-episodes-per-day", "-1"]) == 2
    assert main(["synth", "--out", str(out), "--crunches-per-day", "-1"]) == 2
    assert main(["synth", "--out", str(out), "--daily-availability", "1"]) == 2
    assert main(["synth", "--out", str(out), "--collapses-per-week", "inf"]) == 2  # not a numpy traceback
    assert main(["synth", "--out", str(out), "--zones-per-region", "0"]) == 2
    assert main(["synth", "--out", str(out), "--price-trend-per-week", "-1"]) == 2
    err = capsys.readouterr().err
    assert "daily_availability" in err and "zones_per_region" in err and "price_trend_per_week" in err


def test_drop_statistics_counted_by_hand():
    # Pool 0: 2, 1, 1, 0, 2, 1, 1 (falls after slots 0, 2, 4); pool 1 never offers capacity.
    available = np.array([[2, 0], [1, 0], [1, 0], [0, 0], [2, 0], [1, 0], [1, 0]])
    rates = drop_rates(available)
    assert rates[0] == pytest.approx(3 / 5)  # slots 0-5 offer capacity except slot 3
    assert np.isnan(rates[1])
    # From slot 1 on (a one-slot look back): slot 1 follows a fall and holds, slot 2 follows none
    # and falls, slot 4 follows none and falls, slot 5 follows a fall and holds.
    assert drop_after_drop(available, lookback=1) == (0.0, 1.0)


def test_falls_below_counts_only_drops_deeper_than_the_room_left():
    # One pool: 8 -> 6 (a fall of 2), 6 -> 6, 6 -> 1 (5), 1 -> 1.
    available = np.array([[8], [6], [6], [1], [1]])
    assert falls_below(available, 0) == pytest.approx(2 / 4)
    assert falls_below(available, 2) == pytest.approx(1 / 3)  # the 1 is no case: it offers no more than the room
    assert falls_below(available, 4) == pytest.approx(1 / 3)  # only 6 -> 1 goes deeper than 6 - 4
    assert falls_below(available, 5) == pytest.approx(0.0)
    assert np.isnan(falls_below(available, 8))  # no pool ever offers more than 8


def test_drop_cases_counted_by_hand():
    # Two pools at 2 instances for 27 slots, but pool 0 falls into slot 23 (1) and 25 (0), and
    # pool 1 into slot 26 (1). Cases from slot 24: pool 0 and 1 in slot 24, pool 1 in slot 25
    # (pool 0 offers nothing there).
    available = np.full((27, 2), 2)
    available[23:25, 0], available[25:, 0], available[26, 1] = 1, 0, 1
    features, dropped = drop_cases(available)
    assert FEATURE_HISTORY == 24 and features.shape == (3, len(DROP_FEATURES))
    np.testing.assert_array_equal(
        features,
        [
            [1, 1, 0, 1, 0],  # pool 0, slot 24: fell one slot ago, once in 24 slots, no rise
            [0, 0, 0, 24, 0],  # pool 1, slot 24: never changed, the other pool did not fall into 24
            [0, 0, 0, 24, 1],  # pool 1, slot 25: the other pool fell into this slot
        ],
    )
    np.testing.assert_array_equal(dropped, [True, False, True])
