"""The online policy selector of arXiv 2512.20967: exponential weights over a pool of policies.

No single parameter setting of the prediction-based (``chc``) and prediction-free policies wins
on every market: which one does depends on how predictable the market is right now. The selector
learns it online. A round is one job, because a policy's utility is only known when its job ends:
at the job's first slot the selector picks a pool member from its weights and delegates every
slot of the job to it; after the job, :meth:`SelectorPolicy.update` feeds back either every
member's counterfactual utility on the realised market (full information, Hedge) or only the
played member's (bandit, EXP3). Both keep the regret against the best member in hindsight at
O(sqrt T) over T rounds; ``docs/selector.md`` has the proofs.

The learner's whole state is a small JSON document (:meth:`SelectorPolicy.to_state`), so that it
can live in an Airflow Variable between runs and be restored exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import replace
from datetime import timedelta
from typing import Any, Mapping, Sequence

import numpy as np

from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import Allocation, Job
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.rules import on_demand_cost
from airflow_provider_spotsched.simulation.simulator import DEFAULT_LOOKBACK_HOURS, JobMarket, simulate

STATE_VERSION = 1
ALGORITHMS = ("hedge", "exp3")
CHOICES = ("sample", "leader")
DEFAULT_WARM_UP_ROUNDS = 16
WARM_UP_WINDOWS_PER_HORIZON = 4
# A member that pays this share of the on-demand bill more than the round's best loses 1.
DEFAULT_LOSS_SCALE = 0.02

# The two axes along which the paper builds its pool. CHC spans the commitment level (re-plan
# every slot, or commit to 4 of 24); the prediction-free policy spans its price threshold, its
# safety margin and how far above the cheapest offer it runs ahead of need. CHC members dominate
# the cost of a full-information round (one replay each), so there are two.
DEFAULT_POOL: tuple[dict[str, Any], ...] = (
    {"policy": "chc", "params": {"window": 24, "commit": 1, "forecaster": "persistence"}},
    {"policy": "chc", "params": {"window": 24, "commit": 4, "forecaster": "persistence"}},
    {"policy": "prediction-free", "params": {"price_threshold": 0.9, "safety_slots": 0.0}},
    {"policy": "prediction-free", "params": {"price_threshold": 0.9, "safety_slots": 0.0, "spot_premium": 0.0}},
    {"policy": "prediction-free", "params": {"price_threshold": 0.9, "safety_slots": 0.0, "spot_premium": 0.1}},
    {"policy": "prediction-free", "params": {"price_threshold": 0.7, "safety_slots": 1.0}},
    {"policy": "prediction-free", "params": {"price_threshold": 0.5, "safety_slots": 1.0, "spot_premium": 0.0}},
    {"policy": "uniform-progress", "params": {}},
)

# Replays are pure functions of (member, job, market) and the same ones recur: a report that
# shows the counterfactual utilities and then updates, or fresh selectors warming up for jobs
# submitted close together (their windows are aligned, see _warm_up_windows). A bounded
# per-process memo runs each once.
_REPLAY_CACHE_SIZE = 8192
_replay_cache: OrderedDict[tuple[str, str, str], float] = OrderedDict()


class SelectorStateError(ValueError):
    """A selector state document is malformed; the message names the field and the fix."""


class ExponentialWeights:
    """Hedge (full information) or EXP3 (bandit) over ``K`` members, from cumulative losses.

    Round ``t`` (1-based) plays ``p_t(i) ~ exp(-eta_t * L_{t-1}(i))``. The learning rate is fixed
    at Hedge's ``sqrt(8 ln K / T)`` (EXP3's ``sqrt(2 ln K / (T K))``) up to a known horizon ``T``,
    and anytime, ``sqrt(4 ln K / t)`` (``sqrt(ln K / (t K))``), otherwise or after it: a
    non-increasing schedule, which is what the regret proof needs. Draws come from a
    counter-based generator (``seed``, draw number), so the state is a few numbers.
    """

    def __init__(
        self,
        num_members: int,
        algorithm: str = "hedge",
        choice: str = "sample",
        horizon: int | None = None,
        seed: int = 0,
    ) -> None:
        _check_options(num_members, algorithm, choice, horizon, seed)
        self.algorithm = algorithm
        self.choice = choice
        self.horizon = horizon
        self.seed = seed
        self.cumulative_loss = np.zeros(num_members)
        self.rounds = 0
        self.draws = 0

    @property
    def num_members(self) -> int:
        return len(self.cumulative_loss)

    def eta(self, t: int) -> float:
        """The learning rate of round ``t`` (1-based)."""
        k = self.num_members
        scale = 1.0 if self.algorithm == "hedge" else 1.0 / (4.0 * k)
        if self.horizon is not None and t <= self.horizon:
            return math.sqrt(8.0 * scale * math.log(k) / self.horizon)
        return math.sqrt(4.0 * scale * math.log(k) / t)

    def probabilities(self) -> np.ndarray:
        """The distribution the next round plays."""
        shifted = self.cumulative_loss - self.cumulative_loss.min()
        weights = np.exp(-self.eta(self.rounds + 1) * shifted)
        return weights / weights.sum()

    def choose(self) -> tuple[int, float]:
        """The member of the next round and the probability it was played with."""
        if self.choice == "leader":
            return int(np.argmin(self.cumulative_loss)), 1.0
        p = self.probabilities()
        u = np.random.default_rng([self.seed, self.draws]).random()
        self.draws += 1
        # Round-off can leave the cumulative sum short of 1: fall back on the last member in play.
        index = min(int(np.searchsorted(np.cumsum(p), u, side="right")), int(np.flatnonzero(p)[-1]))
        return index, float(p[index])

    def learn_full(self, losses: Sequence[float]) -> None:
        """A full-information round: every member's loss in [0, 1]."""
        losses = np.asarray(losses, dtype=float)
        if losses.shape != self.cumulative_loss.shape or not np.all((losses >= 0) & (losses <= 1)):
            raise ValueError(f"losses must be {self.num_members} numbers in [0, 1], got {losses.tolist()}")
        self.cumulative_loss += losses
        self.rounds += 1

    def learn_bandit(self, index: int, loss: float, probability: float) -> None:
        """A bandit round: the played member's loss, importance-weighted by its probability."""
        if not 0.0 <= loss <= 1.0 or not 0.0 < probability <= 1.0:
            raise ValueError(f"need a loss in [0, 1] and a probability in (0, 1], got {loss} and {probability}")
        self.cumulative_loss[index] += loss / probability
        self.rounds += 1


class SelectorPolicy(Policy):
    """Picks a pool member per job with Hedge or EXP3 and delegates the job's slots to it.

    :param pool: members as ``{"policy": name, "params": {...}}``, built with ``make_policy``
        (default: :data:`DEFAULT_POOL`).
    :param algorithm: ``"hedge"`` (full-information feedback: every member's counterfactual
        utility) or ``"exp3"`` (bandit feedback: only the played member's).
    :param choice: ``"sample"`` draws the member from the weights (the regret bound holds);
        ``"leader"`` plays the member with the least cumulative loss (follow the leader: no
        variance, but no guarantee against a changing market; Hedge only).
    :param horizon: the number of rounds ``T``, when known, for the fixed learning rate; the
        anytime rate is used without it and after it. Warm-up rounds count.
    :param seed: seeds the member draws.
    :param warm_up_rounds: full-information rounds replayed on history before submission when
        the learner has seen no round yet (0: none).
    :param loss_scale: with Hedge, a member's loss in a round is its utility shortfall from the
        round's best member over ``loss_scale`` x the job's on-demand cost, clipped to [0, 1]
        (see :func:`shortfall_losses`).
    """

    name = "selector"

    def __init__(
        self,
        pool: Sequence[Mapping[str, Any]] | None = None,
        algorithm: str = "hedge",
        choice: str = "sample",
        horizon: int | None = None,
        seed: int = 0,
        warm_up_rounds: int = DEFAULT_WARM_UP_ROUNDS,
        loss_scale: float = DEFAULT_LOSS_SCALE,
    ) -> None:
        self.pool = _check_pool(DEFAULT_POOL if pool is None else pool)
        if not isinstance(warm_up_rounds, int) or isinstance(warm_up_rounds, bool) or warm_up_rounds < 0:
            raise ValueError(f"warm_up_rounds must be an integer >= 0, got {warm_up_rounds!r}")
        self.warm_up_rounds = warm_up_rounds
        if not _is_number(loss_scale) or loss_scale <= 0:
            raise ValueError(f"loss_scale must be a number > 0 (a share of the on-demand cost), got {loss_scale!r}")
        self.loss_scale = float(loss_scale)
        self.learner = ExponentialWeights(len(self.pool), algorithm, choice, horizon, seed)
        self.members = [_build_member(i, entry) for i, entry in enumerate(self.pool)]
        # Separate instances for counterfactual replays, so that a replay never resets the
        # member that is playing the current job.
        self._replayers = [make_policy(e["policy"], e["params"]) for e in self.pool]
        self.labels = tuple(m.label for m in self.members)
        duplicates = sorted({label for label in self.labels if self.labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"pool lists the same member twice: {duplicates}; give each member different params")
        self._keys = tuple(json.dumps(e, sort_keys=True) for e in self.pool)
        self.current: tuple[int, float] | None = None
        self._member_ready = False

    # -- the policy interface ------------------------------------------------------------

    def params(self) -> dict[str, Any]:
        return {
            "pool": [dict(e) for e in self.pool],
            "algorithm": self.learner.algorithm,
            "choice": self.learner.choice,
            "horizon": self.learner.horizon,
            "seed": self.learner.seed,
            "warm_up_rounds": self.warm_up_rounds,
            "loss_scale": self.loss_scale,
        }

    @property
    def label(self) -> str:
        """Short: the pool shows as its size and a digest, not as every member's parameters."""
        digest = hashlib.sha1(json.dumps(self.pool, sort_keys=True).encode()).hexdigest()[:8]
        params = {**self.params(), "pool": f"{len(self.pool)}:{digest}"}
        return f"{self.name}(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")"

    def reset(self, job: Job) -> None:
        """A new job is a new round: the member is chosen at its first slot."""
        self.current = None
        self._member_ready = False

    def decide(self, observation: Observation) -> Allocation:
        """Delegate to this round's member, choosing it (after a lazy warm-up) on first use.

        The warm-up runs here, on the first decision of a learner that has seen no round yet,
        from ``observation.past`` cut at submission; :meth:`warm_up` can also be called before.
        """
        if self.current is None:
            if self.learner.rounds == 0 and self.warm_up_rounds:
                self.warm_up(JobMarket(observation.past, observation.past_offset), observation.job)
            self.current = self.learner.choose()
        member = self.members[self.current[0]]
        if not self._member_ready:
            member.reset(observation.job)
            self._member_ready = True
        return member.decide(observation)

    def planned(self) -> list[Allocation]:
        return self.members[self.current[0]].planned() if self.current is not None else []

    # -- learning ------------------------------------------------------------------------

    @property
    def playing(self) -> str | None:
        """The label of this round's member, once chosen."""
        return None if self.current is None else self.labels[self.current[0]]

    def weights(self) -> dict[str, float]:
        """The distribution the next round is drawn from, by member label."""
        return dict(zip(self.labels, self.learner.probabilities().tolist()))

    def counterfactual_utilities(self, job: Job, job_market: JobMarket) -> dict[str, float]:
        """Every member's utility had it run ``job`` on the realised ``job_market``."""
        return {label: self._replay(i, job, job_market) for i, label in enumerate(self.labels)}

    def update(self, job: Job, job_market: JobMarket, utilities: Mapping[str, float] | None = None) -> dict[str, float]:
        """Close the round of ``job`` with its feedback; returns the losses learnt from, by label.

        ``utilities`` holds realised utilities by member label, typically the played member's
        (the job's own result: passing it saves one replay). Hedge learns every member's loss,
        replaying on ``job_market`` the members ``utilities`` does not name. EXP3 learns the
        played member's loss only, importance-weighted, replayed if ``utilities`` lacks it.
        """
        known = dict(utilities or {})
        unknown = sorted(set(known) - set(self.labels))
        if unknown:
            raise ValueError(f"utilities name no pool member: {unknown}; the members are {list(self.labels)}")
        on_demand = on_demand_cost(job, job_market.market.on_demand_price)
        if self.learner.algorithm == "hedge":
            for index, label in enumerate(self.labels):
                if label not in known:
                    known[label] = self._replay(index, job, job_market)
            losses = shortfall_losses(known, self.loss_scale * on_demand)
            self.learner.learn_full([losses[label] for label in self.labels])
        else:
            if self.current is None:
                raise ValueError("exp3 feedback needs the member played this round: run the job through decide first")
            index, probability = self.current
            label = self.labels[index]
            utility = known[label] if label in known else self._replay(index, job, job_market)
            losses = {label: normalised_loss(job, utility, on_demand)}
            self.learner.learn_bandit(index, losses[label], probability)
        self.current = None
        self._member_ready = False
        return losses

    def warm_up(self, history: JobMarket, job: Job, rounds: int | None = None) -> int:
        """Full-information rounds on windows of ``history`` that end at or before submission.

        Only the slots before ``history.offset`` are read. Returns the number of rounds learnt;
        it is below ``rounds`` (default: ``warm_up_rounds``) when the history is short.
        """
        rounds = self.warm_up_rounds if rounds is None else rounds
        past = history.market.window(0, history.offset)
        windows = _warm_up_windows(past, job, rounds)
        on_demand = on_demand_cost(job, past.on_demand_price)
        for window_job, window in windows:
            losses = shortfall_losses(self.counterfactual_utilities(window_job, window), self.loss_scale * on_demand)
            self.learner.learn_full([losses[label] for label in self.labels])
        return len(windows)

    def _replay(self, index: int, job: Job, job_market: JobMarket) -> float:
        key = (self._keys[index], json.dumps(job.to_dict(), sort_keys=True), _market_key(job_market))
        if key in _replay_cache:
            _replay_cache.move_to_end(key)
            return _replay_cache[key]
        utility = simulate(self._replayers[index], job, job_market).outcome.utility
        _replay_cache[key] = utility
        if len(_replay_cache) > _REPLAY_CACHE_SIZE:
            _replay_cache.popitem(last=False)
        return utility

    # -- state ---------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The whole learner as a small JSON-serialisable document (see :meth:`from_state`).

        The learning-rate schedule follows from ``algorithm``, ``horizon`` and ``rounds``; the
        generator from ``seed`` and ``draws``; ``current`` is the member of an unfinished round.
        """
        current = None
        if self.current is not None:
            current = {"member": self.labels[self.current[0]], "probability": self.current[1]}
        return {
            "version": STATE_VERSION,
            **self.params(),
            "cumulative_loss": dict(zip(self.labels, self.learner.cumulative_loss.tolist())),
            "rounds": self.learner.rounds,
            "draws": self.learner.draws,
            "current": current,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "SelectorPolicy":
        """Restore a selector exactly from :meth:`to_state`'s document."""
        if not isinstance(state, Mapping):
            raise SelectorStateError(f"selector state must be a JSON object, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise SelectorStateError(
                f"selector state field 'version' is {state.get('version')!r}; this code reads version {STATE_VERSION}: "
                "start a fresh selector or convert the document"
            )
        fields = ("version", "pool", "algorithm", "choice", "horizon", "seed", "warm_up_rounds", "loss_scale")
        fields += ("cumulative_loss", "rounds", "draws", "current")
        missing = [f for f in fields if f not in state]
        unknown = sorted(set(state) - set(fields))
        if missing or unknown:
            raise SelectorStateError(f"selector state has missing field(s) {missing} and unknown field(s) {unknown}")
        try:
            selector = cls(**{f: state[f] for f in fields[1:8]})
        except (TypeError, ValueError) as exc:
            raise SelectorStateError(f"selector state: {exc}") from None
        losses = state["cumulative_loss"]
        if not isinstance(losses, Mapping) or sorted(losses) != sorted(selector.labels):
            raise SelectorStateError(
                f"selector state field 'cumulative_loss' must map exactly the pool's members {list(selector.labels)} "
                f"to numbers; got keys {sorted(losses) if isinstance(losses, Mapping) else losses!r}"
            )
        values = [losses[label] for label in selector.labels]
        if not all(_is_number(v) and v >= 0 for v in values):
            raise SelectorStateError(
                f"selector state field 'cumulative_loss' holds a value that is not a finite number >= 0: {values}"
            )
        for name in ("rounds", "draws"):
            if not _is_count(state[name]):
                raise SelectorStateError(f"selector state field {name!r} must be an integer >= 0, got {state[name]!r}")
        selector.learner.cumulative_loss = np.asarray(values, dtype=float)
        selector.learner.rounds = state["rounds"]
        selector.learner.draws = state["draws"]
        selector.current = _read_current(state["current"], selector.labels)
        return selector


def shortfall_losses(utilities: Mapping[str, float], scale: float) -> dict[str, float]:
    """Full-information losses in [0, 1]: each member's shortfall from the round's best, over ``scale``.

    The members of a pool differ by a few percent of a job's cost, so measuring them against the
    job's whole value (as :func:`normalised_loss` must, lacking the other members) would leave the
    weights near uniform for hundreds of rounds. Against the round's best, a member ``scale``
    dollars worse loses 1 and the best loses 0: the same regret bound, in these units, learnt
    from a handful of jobs. ``scale`` depends on the job only, never on the round's spread.
    """
    best = max(utilities.values())
    return {label: min(max((best - u) / scale, 0.0), 1.0) if scale > 0 else 0.0 for label, u in utilities.items()}


def normalised_loss(job: Job, utility: float, on_demand: float) -> float:
    """A round's loss in [0, 1]: the utility's shortfall from ``V0``, over ``V0`` plus ``on_demand``.

    0 is finishing in time for free, ``on_demand / (V0 + on_demand)`` is the on-demand reference,
    1 is earning nothing while paying the on-demand bill (worse is clipped to 1). The scale
    depends on the job only, so all members of a round are measured alike.
    """
    scale = job.value + on_demand
    if scale <= 0:
        return 0.0
    return min(max((job.value - utility) / scale, 0.0), 1.0)


def _warm_up_windows(past: SlotMarket, job: Job, rounds: int) -> list[tuple[Job, JobMarket]]:
    """Up to ``rounds`` past jobs shaped like ``job`` inside ``past``, oldest first.

    Windows are ``job.horizon_slots`` long and overlap: they end every quarter of that length,
    on a grid counted from the epoch (so jobs submitted close together share windows, and their
    replays), which gives a few days of history enough rounds to tell the members apart. Each
    carries up to the simulator's default lookback of history for the members' forecasters.
    """
    length = job.horizon_slots
    stride = max(1, math.ceil(length / WARM_UP_WINDOWS_PER_HORIZON))
    slot_seconds = job.slot_hours * 3600.0
    base = math.floor(past.start.timestamp() / slot_seconds + 1e-9)
    end = past.num_slots - (base + past.num_slots) % stride
    lookback = int(DEFAULT_LOOKBACK_HOURS // job.slot_hours)
    windows = []
    while len(windows) < rounds and end - length >= 0:
        start = end - length
        history = min(start, lookback)
        window_job = replace(job, start=past.start + timedelta(hours=start * job.slot_hours))
        windows.append((window_job, JobMarket(past.window(start - history, history + length), history)))
        end -= stride
    return windows[::-1]


def _market_key(job_market: JobMarket) -> str:
    market = job_market.market
    digest = hashlib.blake2b(digest_size=16)
    header = (market.pools, market.start.timestamp(), market.slot_hours, market.on_demand_price, job_market.offset)
    digest.update(repr(header).encode())
    digest.update(np.ascontiguousarray(market.spot_price, dtype=float).tobytes())
    digest.update(np.ascontiguousarray(market.available, dtype=np.int64).tobytes())
    return digest.hexdigest()


def _check_options(num_members: int, algorithm: str, choice: str, horizon: int | None, seed: int) -> None:
    if num_members < 1:
        raise ValueError("pool is empty; give at least one member")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
    if choice not in CHOICES:
        raise ValueError(f"choice must be one of {list(CHOICES)}, got {choice!r}")
    if algorithm == "exp3" and choice == "leader":
        raise ValueError('choice "leader" needs full information; use choice="sample" with algorithm="exp3"')
    if horizon is not None and not (_is_count(horizon) and horizon > 0):
        raise ValueError(f"horizon must be a positive integer (rounds) or None for the anytime rate, got {horizon!r}")
    if not _is_count(seed):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


def _check_pool(pool: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    if isinstance(pool, (str, bytes, Mapping)) or not isinstance(pool, Sequence) or not pool:
        raise ValueError('pool must be a non-empty list of {"policy": name, "params": {...}}')
    checked = []
    for i, entry in enumerate(pool):
        if not isinstance(entry, Mapping) or "policy" not in entry or set(entry) - {"policy", "params"}:
            raise ValueError(f'pool[{i}] must be {{"policy": name, "params": {{...}}}}, got {entry!r}')
        params = entry.get("params") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"pool[{i}].params must be an object of parameters, got {params!r}")
        if entry["policy"] == SelectorPolicy.name:
            raise ValueError(f"pool[{i}] is a selector; a pool holds plain policies")
        checked.append({"policy": entry["policy"], "params": dict(params)})
    return tuple(checked)


def _build_member(index: int, entry: Mapping[str, Any]) -> Policy:
    try:
        member = make_policy(entry["policy"], entry["params"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"pool[{index}]: {exc}") from None
    if getattr(member, "uses_future", False):
        raise ValueError(f"pool[{index}] ({member.label}) sees the future; the selector is an online policy")
    return member


def _read_current(current: Any, labels: Sequence[str]) -> tuple[int, float] | None:
    if current is None:
        return None
    if (
        not isinstance(current, Mapping)
        or current.get("member") not in labels
        or not _is_number(current.get("probability"))
        or not 0.0 < current["probability"] <= 1.0
    ):
        raise SelectorStateError(
            f"selector state field 'current' must be null or {{\"member\": one of {list(labels)}, "
            f'"probability": a number in (0, 1]}}, got {current!r}'
        )
    return labels.index(current["member"]), float(current["probability"])


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
