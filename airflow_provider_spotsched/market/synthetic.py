"""Seeded synthetic spot markets: markets the project has never seen, to evaluate on.

The shipped traces are two markets over a few weeks; tuning to them is easy and proves little.
This generator writes traces in the spec's CSV format from a seed, with the three behaviours a
scheduler must survive, each on or off:

- **regime-switching availability**: every pool moves between three regimes (plenty, scarce,
  none) by a Markov chain with hour-scale persistence; a market-wide shock moves every pool to
  its scarce regime at once (correlated capacity, as when a region runs short);
- **diurnal prices**: each pool's spot price follows a daily cycle with its own phase (local
  working hours) and noise, and rises when capacity is scarce;
- **sudden capacity collapse**: a few times per trace every pool loses all capacity for hours
  (a preemption storm), with no warning in the prices;
- **flapping pools** (off by default): episodes of hours in which a pool's count falls for an
  hour at a time and comes back, so that one drop makes the next likely, as in the shipped
  traces (there a drop follows one in the last three hours with about 2-3 times the chance it
  has otherwise, :func:`~airflow_provider_spotsched.market.drops.drop_after_drop`); the regimes
  alone make drops independent of the last ones;
- **spreading crunches** (off by default): waves of capacity loss that start in one pool and
  reach each other pool an hour or more later, so a drop in one pool warns of drops in the
  others, as in the shipped traces (there another pool's drop in the same hour is the strongest
  sign of a pool's drop in the next, ``scripts/drop_predictability.py``); the market-wide shocks
  and collapses hit every pool in the same hour, so they give no such warning;
- **daily availability** (off by default): each pool offers less in the hours its price peaks
  (its region's working day, when other users take the capacity), so that yesterday's count at
  this hour says something about tomorrow's, as in the shipped AWS trace (there "the same as a
  day ago" is right more often at 12 h than "the same as now"); the regimes alone have no time
  of day;
- **a price trend** (off by default): every pool's spot price drifts by a share per week, down
  as a GPU generation gets cheaper once a newer one ships, or up as demand for it grows, so
  that prices leave the range their history showed; on a falling market a job meets prices
  below any it saw before submission, the case the cost guard's exact bound leaves out
  (``docs/guard.md``, case (d)); deterministic, so the rest of a seed's market is unchanged;
- **regions** (off by default): consecutive pools form regions of ``zones_per_region`` zones
  that share one price series, as a cloud's zones in one region often do (GCP's H100 zones of a
  region cost the same; many AWS zones sit at one price), so that zones tie on price and only
  their capacity tells them apart; a scarce zone still costs more than its neighbours.

``capacity`` is the count a pool offers in its plenty regime; ticks are ``tick_minutes`` apart.
The same seed and settings always give the same file (numpy's PCG64 from ``seed``).
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

PLENTY, SCARCE, NONE = 0, 1, 2
MAX_DAYS = 3660  # ten years of ticks: more is a typo, and would run for minutes
FLAP_STREAM = 1  # the flapping episodes' random stream, apart from the seed's main one
CRUNCH_STREAM = 2  # the spreading crunches' random stream
REGIME_SHARE = {PLENTY: 1.0, SCARCE: 0.25, NONE: 0.0}
"""The share of a pool's capacity each regime offers (scarce: a quarter, rounded down, at least 1)."""
REGIME_MOVES = {PLENTY: (SCARCE, NONE), SCARCE: (PLENTY, NONE), NONE: (SCARCE, PLENTY)}
"""Where a pool goes when it leaves a regime: the first with :data:`FIRST_MOVE_CHANCE`, else the second."""
FIRST_MOVE_CHANCE = 0.7
MAX_EVENTS_PER_DAY = 24  # one shock, flap episode or crunch an hour: more is a typo (and overflows the draws)


@dataclass(frozen=True)
class SyntheticMarketConfig:
    """What to generate; every behaviour can be switched off to isolate it.

    :param seed: the random seed; the same seed gives the same trace.
    :param pools: number of spot pools (named ``syn-a``, ``syn-b``, ...).
    :param days: trace length in days.
    :param tick_minutes: minutes between ticks.
    :param capacity: instances a pool offers when capacity is plentiful.
    :param on_demand_price: USD per instance-hour on demand (every pool).
    :param spot_discount: mean spot price as a fraction of on-demand, per pool drawn around it.
    :param regimes: switch availability between plenty, scarce and none (else always plenty).
    :param mean_regime_hours: mean hours a pool stays in one regime.
    :param shock_rate_per_day: market-wide shocks (every pool scarce at once) per day.
    :param diurnal_amplitude: the daily price cycle's amplitude, as a fraction of the mean (0: flat).
    :param collapses_per_week: capacity collapses (every pool at 0) per week.
    :param collapse_hours: (shortest, longest) length of a collapse, hours.
    :param flap_episodes_per_day: flapping episodes per pool and day (0: none). Drawn from their
        own random stream, so the rest of a seed's market is the same with or without them.
    :param flap_hours: (shortest, longest) length of an episode, hours; in each of its hours the
        pool keeps a uniform random share of its count with probability 1/2.
    :param crunches_per_day: spreading crunches per day (0: none), from their own random stream.
        A crunch hits one pool, then in each of the next ``crunch_hours`` hours each pool not yet
        hit with probability ``crunch_spread``; a hit pool keeps a uniform random share of at
        most half its count for ``crunch_hit_hours`` (shortest, longest) hours.
    :param daily_availability: the share of a pool's count that its busiest hour takes (0: none),
        on a daily cycle peaking when the pool's price does; deterministic, so the rest of a seed's
        market is the same with or without it.
    :param price_trend_per_week: the spot prices' drift, a share per week compounded (0: none):
        -0.1 makes every price fall 10% a week, 0.1 rise 10%; prices stay capped just below on-demand.
    :param zones_per_region: pools per region (1: none); a region's zones take its first zone's
        price series (mean, daily phase and noise). The draws are those of the seed either way, so
        the rest of its market is unchanged.
    :param start: the first tick (UTC).
    """

    seed: int = 0
    pools: int = 6
    days: float = 21.0
    tick_minutes: float = 10.0
    capacity: int = 16
    on_demand_price: float = 10.0
    spot_discount: float = 0.35
    regimes: bool = True
    mean_regime_hours: float = 8.0
    shock_rate_per_day: float = 0.5
    diurnal_amplitude: float = 0.3
    collapses_per_week: float = 1.0
    collapse_hours: tuple[float, float] = (3.0, 12.0)
    flap_episodes_per_day: float = 0.0
    flap_hours: tuple[float, float] = (3.0, 12.0)
    crunches_per_day: float = 0.0
    crunch_hours: int = 6
    crunch_spread: float = 0.5
    crunch_hit_hours: tuple[float, float] = (1.0, 6.0)
    daily_availability: float = 0.0
    price_trend_per_week: float = 0.0
    zones_per_region: int = 1
    start: datetime = datetime(2026, 1, 5, tzinfo=timezone.utc)

    def __post_init__(self) -> None:
        checks = {  # setting: (within range, the range)
            "seed": (isinstance(self.seed, int) and self.seed >= 0, "a whole number >= 0"),
            "pools": (_whole(self.pools) and 1 <= self.pools <= 26, "a whole number, 1 to 26"),
            "tick_minutes": (0 < self.tick_minutes <= 60, "in (0, 60]"),
            "days": (
                math.isfinite(self.days) and 0 < self.days <= MAX_DAYS
                and (not 0 < self.tick_minutes <= 60 or self.days * 24 * 60 / self.tick_minutes >= 2),
                f"at least two ticks and at most {MAX_DAYS} days",
            ),
            "capacity": (_whole(self.capacity) and self.capacity >= 1, "a whole number >= 1"),
            "on_demand_price": (self.on_demand_price > 0, "> 0"),
            "spot_discount": (0 < self.spot_discount < 1, "in (0, 1)"),
            "mean_regime_hours": (self.mean_regime_hours > 0, "> 0"),
            "shock_rate_per_day": (_rate(self.shock_rate_per_day, MAX_EVENTS_PER_DAY), f"in [0, {MAX_EVENTS_PER_DAY}]"),
            "diurnal_amplitude": (0 <= self.diurnal_amplitude < 1, "in [0, 1)"),
            "collapses_per_week": (_rate(self.collapses_per_week, 7 * MAX_EVENTS_PER_DAY), f"in [0, {7 * MAX_EVENTS_PER_DAY}]"),
            "collapse_hours": (0 < self.collapse_hours[0] <= self.collapse_hours[1], "0 < shortest <= longest"),
            "flap_episodes_per_day": (_rate(self.flap_episodes_per_day, MAX_EVENTS_PER_DAY), f"in [0, {MAX_EVENTS_PER_DAY}]"),
            "flap_hours": (0 < self.flap_hours[0] <= self.flap_hours[1], "0 < shortest <= longest"),
            "crunches_per_day": (_rate(self.crunches_per_day, MAX_EVENTS_PER_DAY), f"in [0, {MAX_EVENTS_PER_DAY}]"),
            "crunch_hours": (_whole(self.crunch_hours) and self.crunch_hours >= 1, "a whole number >= 1"),
            "crunch_spread": (0 <= self.crunch_spread <= 1, "in [0, 1]"),
            "crunch_hit_hours": (0 < self.crunch_hit_hours[0] <= self.crunch_hit_hours[1], "0 < shortest <= longest"),
            "daily_availability": (0 <= self.daily_availability < 1, "in [0, 1)"),
            "price_trend_per_week": (-1 < self.price_trend_per_week <= 1, "in (-1, 1]"),
            "zones_per_region": (_whole(self.zones_per_region) and self.zones_per_region >= 1, "a whole number >= 1"),
        }
        wrong = [f"{name}={getattr(self, name)!r} (must be {allowed})" for name, (ok, allowed) in checks.items() if not ok]
        if wrong:
            raise ValueError(f"synthetic market setting(s) out of range: {'; '.join(wrong)}")
        if self.start.tzinfo is None:
            raise ValueError("start must be a UTC datetime (with tzinfo)")

    @property
    def pool_names(self) -> list[str]:
        return [f"syn-{chr(ord('a') + i)}" for i in range(self.pools)]

    @property
    def ticks(self) -> int:
        return int(self.days * 24 * 60 / self.tick_minutes)


@dataclass(frozen=True)
class SyntheticMarket:
    """The generated series, one column per pool: what :func:`write_trace` writes."""

    config: SyntheticMarketConfig
    spot_price: np.ndarray  # (ticks, pools) USD per instance-hour
    available: np.ndarray  # (ticks, pools) instance counts
    collapses: tuple[tuple[int, int], ...]  # (first tick, end tick) of every collapse


def generate(config: SyntheticMarketConfig) -> SyntheticMarket:
    """The market ``config`` describes (deterministic in ``config.seed``)."""
    rng = np.random.default_rng(config.seed)
    ticks, pools, per_hour = config.ticks, config.pools, 60.0 / config.tick_minutes
    regime = _regimes(config, rng, ticks, per_hour)
    counts = regime_counts(config.capacity)
    available = np.array([counts[PLENTY], counts[SCARCE], counts[NONE]])[regime]
    if config.flap_episodes_per_day > 0:
        _flap(config, available, per_hour)
    if config.crunches_per_day > 0:
        _crunch(config, available, per_hour)
    collapses = _collapses(config, rng, ticks, per_hour)
    for first, end in collapses:
        available[first:end, :] = 0

    hours = np.arange(ticks) / per_hour
    mean = config.on_demand_price * config.spot_discount * rng.uniform(0.7, 1.3, pools)
    phase = rng.uniform(0.0, 24.0, pools)
    region_first = np.arange(pools) // config.zones_per_region * config.zones_per_region  # each pool's region's first zone
    mean, phase = mean[region_first], phase[region_first]
    daily = np.sin(2 * math.pi * (hours[:, None] - phase[None, :]) / 24.0)  # 1 at each pool's price peak
    cycle = 1.0 + config.diurnal_amplitude * daily
    trend = (1.0 + config.price_trend_per_week) ** (hours / (7 * 24.0))
    if config.daily_availability > 0:
        _keep_share(available, 1.0 - config.daily_availability * (1.0 + daily) / 2.0)
    noise = np.exp(rng.normal(0.0, 0.03, (ticks, pools)))[:, region_first]
    scarcity = np.where(regime == PLENTY, 1.0, 1.4)  # a short pool costs more
    spot = np.minimum(mean[None, :] * cycle * trend[:, None] * noise * scarcity, config.on_demand_price * 0.95)
    return SyntheticMarket(config, np.round(spot, 4), available, tuple(collapses))


def regime_counts(capacity: int) -> dict[int, int]:
    """The count each regime offers a pool of ``capacity``: its share, rounded down, and at least 1
    while scarce (a scarce pool still offers something)."""
    counts = {regime: int(np.floor(share * capacity)) for regime, share in REGIME_SHARE.items()}
    counts[SCARCE] = max(counts[SCARCE], 1)
    return counts


def write_trace(market: SyntheticMarket, path: str | Path) -> Path:
    """The market as a trace file in the spec's format (gzip when ``path`` ends in ``.gz``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = market.config
    opener = gzip.open if path.suffix == ".gz" else open
    step = timedelta(minutes=config.tick_minutes)
    with opener(path, "wt", newline="", encoding="utf-8") as handle:
        handle.write("timestamp,market,spot_price,available,on_demand_price\n")
        for t in range(config.ticks):
            stamp = (config.start + t * step).strftime("%Y-%m-%dT%H:%M:%SZ")
            for m, pool in enumerate(config.pool_names):
                handle.write(
                    f"{stamp},{pool},{market.spot_price[t, m]:.4f},{market.available[t, m]},{config.on_demand_price:.4f}\n"
                )
    return path


def _regimes(config: SyntheticMarketConfig, rng: np.random.Generator, ticks: int, per_hour: float) -> np.ndarray:
    """Each pool's regime per tick: a persistent Markov chain, plus market-wide shocks."""
    regime = np.full((ticks, config.pools), PLENTY, dtype=int)
    if not config.regimes:
        return regime
    leave = 1.0 / (config.mean_regime_hours * per_hour)  # chance per tick of leaving the regime
    state = rng.choice([PLENTY, SCARCE, NONE], size=config.pools, p=[0.6, 0.3, 0.1])
    shock_chance = config.shock_rate_per_day / (24.0 * per_hour)
    shock_left = 0
    for t in range(ticks):
        for m in range(config.pools):
            if rng.random() < leave:
                state[m] = REGIME_MOVES[int(state[m])][0 if rng.random() < FIRST_MOVE_CHANCE else 1]
        if shock_left == 0 and rng.random() < shock_chance:
            shock_left = int(rng.uniform(1.0, 4.0) * per_hour)
        regime[t] = np.where(shock_left > 0, np.maximum(state, SCARCE), state)
        shock_left = max(shock_left - 1, 0)
    return regime


def _flap(config: SyntheticMarketConfig, available: np.ndarray, per_hour: float) -> None:
    """Lower ``available`` in place in flapping episodes: a Poisson number per pool, at uniform
    times; in each hour of one, with probability 1/2, the pool keeps a uniform share of its count."""
    rng = np.random.default_rng([config.seed, FLAP_STREAM])
    ticks, hour = available.shape[0], max(int(round(per_hour)), 1)
    for m in range(config.pools):
        for _ in range(rng.poisson(config.flap_episodes_per_day * config.days)):
            first = int(rng.integers(0, ticks))
            end = min(first + max(int(rng.uniform(*config.flap_hours) * per_hour), 1), ticks)
            for start in range(first, end, hour):
                if rng.random() < 0.5:
                    _keep_share(available[start : min(start + hour, end), m], rng.uniform(0.0, 1.0))


def _crunch(config: SyntheticMarketConfig, available: np.ndarray, per_hour: float) -> None:
    """Lower ``available`` in place in spreading crunches: a Poisson number, each starting on a
    whole hour in a random pool and spreading to the others hour by hour."""
    rng = np.random.default_rng([config.seed, CRUNCH_STREAM])
    ticks, hour = available.shape[0], max(int(round(per_hour)), 1)
    for _ in range(rng.poisson(config.crunches_per_day * config.days)):
        first = int(rng.integers(0, max(ticks // hour, 1))) * hour
        hit_at = {int(rng.integers(0, config.pools)): first}
        for step in range(1, config.crunch_hours + 1):
            for m in range(config.pools):
                if m not in hit_at and rng.random() < config.crunch_spread:
                    hit_at[m] = first + step * hour
        for m, start in sorted(hit_at.items()):
            end = min(start + max(int(rng.uniform(*config.crunch_hit_hours) * per_hour), 1), ticks)
            _keep_share(available[start:end, m], rng.uniform(0.0, 0.5))


def _keep_share(counts: np.ndarray, share: float | np.ndarray) -> None:
    """Lower ``counts`` (a view into the market's counts) in place to ``share`` of each (one share,
    or one per count), rounded down."""
    counts[:] = np.floor(counts * share).astype(int)


def _collapses(config: SyntheticMarketConfig, rng: np.random.Generator, ticks: int, per_hour: float) -> list[tuple[int, int]]:
    """Windows in which every pool has no capacity: a Poisson number, at uniform times."""
    count = rng.poisson(config.collapses_per_week * config.days / 7.0)
    windows = []
    for _ in range(count):
        first = int(rng.integers(0, ticks))
        length = int(rng.uniform(*config.collapse_hours) * per_hour)
        windows.append((first, min(first + max(length, 1), ticks)))
    return sorted(windows)


def _whole(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _rate(value: object, most: float) -> bool:
    """A finite event rate in [0, most]."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= most
