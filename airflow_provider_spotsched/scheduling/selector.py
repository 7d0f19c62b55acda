"""The online policy selector of arXiv 2512.20967: exponential weights over a pool of policies.

No single parameter setting of the prediction-based (``chc``) and prediction-free policies wins
on every market, nor on every kind of job: which one does depends on how predictable the market
is right now and on the job's size, deadline slack and reconfiguration overhead. The selector
learns it online. A round is one job, because a policy's utility is only known when its job ends:
:meth:`SelectorPolicy.open_round` draws a pool member from the weights of the job's kind
(:func:`job_context`), which plays every slot of the job; after the job,
:meth:`SelectorPolicy.close_round` feeds back either every member's counterfactual utility on the
realised market (full information: Hedge with AdaHedge's adaptive learning rate) or only the
played member's (bandit feedback: EXP3). Both keep the regret against the best member in
hindsight at O(sqrt T) over the T rounds of each kind of job; ``docs/selector.md`` has the proofs.

The learner's whole state is a small JSON document (:meth:`SelectorPolicy.to_state`), so that it
can live in an Airflow Variable between runs and be restored exactly.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import numpy as np

from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.guard import DEFAULT_GUARD
from airflow_provider_spotsched.scheduling.model import Allocation, Job, is_number
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.replay import DEFAULT_LOOKBACK_HOURS, JobMarket, simulate
from airflow_provider_spotsched.scheduling.rules import on_demand_cost
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput

STATE_VERSION = 2
ALGORITHMS = ("hedge", "exp3")
# Past windows replayed when a kind of job is first seen: with windows every quarter of the job's
# horizon, the last three job lengths of history (about three days for a day-long job).
DEFAULT_WARM_UP_ROUNDS = 12
WARM_UP_WINDOWS_PER_HORIZON = 4
# Kinds of job whose weights the state keeps; the least recently played is dropped beyond this.
MAX_CONTEXTS = 32
# Draws walk the golden-ratio (Weyl) sequence: each is uniform, and successive ones spread evenly.
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0

# The commit-1 CHC member's prior weight against 1 for each other member: 14 of 21, 2/3.
FAVOURITE_PRIOR = 14

# The two axes along which the paper builds its pool. CHC spans the commitment level (re-plan
# every slot, or commit to 4 of 24); the prediction-free policy spans its price threshold, its
# safety margin and how far above the cheapest offer it runs ahead of need. CHC members dominate
# the cost of a full-information round (one replay each; the blend's about as much as the seven
# others together), so there are two. The commit-1 CHC member was the best single member in
# hindsight on most markets measured, while a kind's few warm-up windows often pointed
# elsewhere, so it starts twice as likely as the seven others together; which forecaster it
# should plan on (the sojourn chain's availability chances or `auto`'s) differs from market to
# market, so it plans on their equal mixture, the blend (docs/selector.md, "The favourite"). Every
# member but UP runs under the cost guard (scheduling/guard.py): whichever the learner draws, no
# job costs much more than UP would have paid. A stored state keeps the pool it was made with,
# so states saved before the guard load and run unguarded, and states saved before the prior
# keep uniform weights.
DEFAULT_POOL: tuple[dict[str, Any], ...] = (
    {
        "policy": "chc",
        "params": {"window": 24, "commit": 1, "forecaster": "blend", "guard": DEFAULT_GUARD},
        "prior": FAVOURITE_PRIOR,
    },
    {"policy": "chc", "params": {"window": 24, "commit": 4, "forecaster": "sojourn-chain", "guard": DEFAULT_GUARD}},
    {"policy": "prediction-free", "params": {"price_threshold": 0.9, "safety_slots": 0.0, "guard": DEFAULT_GUARD}},
    {
        "policy": "prediction-free",
        "params": {"price_threshold": 0.9, "safety_slots": 0.0, "spot_premium": 0.0, "guard": DEFAULT_GUARD},
    },
    {
        "policy": "prediction-free",
        "params": {"price_threshold": 0.9, "safety_slots": 0.0, "spot_premium": 0.1, "guard": DEFAULT_GUARD},
    },
    {"policy": "prediction-free", "params": {"price_threshold": 0.7, "safety_slots": 1.0, "guard": DEFAULT_GUARD}},
    {
        "policy": "prediction-free",
        "params": {"price_threshold": 0.5, "safety_slots": 1.0, "spot_premium": 0.0, "guard": DEFAULT_GUARD},
    },
    {"policy": "uniform-progress", "params": {}},
)

logger = logging.getLogger(__name__)

# Replays are pure functions of (member, job, market) and the same ones recur: a report that
# shows the counterfactual utilities and then updates, or fresh selectors warming up for jobs
# submitted close together (their windows are aligned, see _warm_up_windows). A bounded
# per-process memo runs each once.
_REPLAY_CACHE_SIZE = 8192
_replay_cache: OrderedDict[tuple[str, str, str, str, bool], float] = OrderedDict()


class SelectorStateError(ValueError):
    """A selector state document is malformed; the message names the field and the fix."""


@dataclass(frozen=True)
class Round:
    """One job's draw: the member that plays the job, and what closing its round needs.

    :param member_index: the member's position in the pool.
    :param label: the member's label.
    :param probability: the probability it was drawn with (EXP3's importance weight).
    :param draw: its number in the selector's draw sequence; ``None`` for a round restored from
        a state document, which records only the member and its probability.
    """

    member_index: int
    label: str
    probability: float
    draw: int | None


class ExponentialWeights:
    """Hedge (full information) or EXP3 (bandit) over ``K`` members, from cumulative losses.

    Round ``t`` (1-based) plays ``p_t(i) ~ pi(i) exp(-eta_t * L_{t-1}(i))`` (``pi``: the prior,
    below; uniform by default). Hedge takes AdaHedge's
    rate ``eta_t = ln K / Delta_{t-1}``, where ``Delta`` sums the mixability gaps (how much the
    played mixture lost beyond its mix loss): no horizon and no loss scale to choose, it follows
    the leader while the leader keeps winning and hedges when the rounds disagree, and its regret
    stays under ``sqrt(T ln K) + 2`` with the uniform prior. Before any gap (``Delta = 0``) it
    plays the leaders in proportion to their prior. EXP3 takes the anytime rate ``sqrt(ln K / (t K))``.

    ``active`` masks out the members that cannot run this learner's kind of job (a
    single-instance member on an N_max > 1 job): they are never played and learn nothing, so
    the learner is the same algorithm over the ``K`` active members, with ``ln K`` of those.

    ``prior`` weighs the members before any loss (relative weights, normalised over the active
    members; default: uniform). The regret against
    member ``i`` is then at most ``(1 + ln(1/pi(i)) / ln K)`` times the mixability gaps' sum
    (twice it for the uniform prior), still O(sqrt T) against every member (docs/selector.md).
    """

    def __init__(
        self,
        num_members: int,
        algorithm: str = "hedge",
        active: Sequence[bool] | np.ndarray | None = None,
        prior: Sequence[float] | np.ndarray | None = None,
    ) -> None:
        if num_members < 1:
            raise ValueError("pool is empty; give at least one member")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
        self.algorithm = algorithm
        self.cumulative_loss = np.zeros(num_members)
        self.active = np.ones(num_members, dtype=bool) if active is None else np.asarray(active, dtype=bool)
        if self.active.shape != (num_members,) or not self.active.any():
            raise ValueError(f"active must be {num_members} flags with at least one member active, got {active!r}")
        weights = np.ones(num_members) if prior is None else np.asarray(prior, dtype=float)
        if weights.shape != (num_members,) or not np.all(np.isfinite(weights) & (weights > 0)):
            raise ValueError(f"prior must be {num_members} finite weights > 0, got {prior!r}")
        self.prior = weights / weights.max()  # relative weights: scaled so that no sum of them overflows
        self.rounds = 0
        self.mixability_gap = 0.0

    @property
    def num_members(self) -> int:
        return len(self.cumulative_loss)

    def eta(self) -> float:
        """The learning rate of the next round (``inf``: follow the leaders)."""
        k = int(self.active.sum())
        if k == 1:  # a lone member: nothing to learn, every rate plays it (EXP3's formula would give 0)
            return math.inf
        if self.algorithm == "exp3":
            return math.sqrt(math.log(k) / ((self.rounds + 1) * k))
        return math.log(k) / self.mixability_gap if self.mixability_gap > 0 else math.inf

    def probabilities(self) -> np.ndarray:
        """The distribution the next round plays (0 for an inactive member); at ``eta = inf`` the
        leaders, in proportion to their prior weights."""
        losses = np.where(self.active, self.cumulative_loss, np.inf)
        shifted = losses - losses.min()
        eta = self.eta()
        if math.isinf(eta):
            weights = np.where(shifted == 0, self.prior, 0.0)
        else:
            log_weights = np.where(self.active, self._log_prior() - eta * np.where(self.active, shifted, 0.0), -np.inf)
            weights = np.exp(log_weights - log_weights.max())
        return weights / weights.sum()

    def _log_prior(self) -> np.ndarray:
        """``ln pi`` up to a constant, which every use normalises away (``-inf`` for an inactive
        member); relative to the largest active weight, so a uniform prior adds exactly 0."""
        weights = np.where(self.active, self.prior, 0.0)
        with np.errstate(divide="ignore"):
            return np.log(weights) - np.log(weights.max())

    def choose(self, u: float) -> tuple[int, float]:
        """The member a uniform draw ``u`` in [0, 1) picks, and the probability it was played with."""
        p = self.probabilities()
        # Round-off can leave the cumulative sum short of 1: fall back on the last member in play.
        index = min(int(np.searchsorted(np.cumsum(p), u, side="right")), int(np.flatnonzero(p)[-1]))
        return index, float(p[index])

    def learn_full(self, losses: Sequence[float] | np.ndarray) -> None:
        """A full-information round: every member's loss in [0, 1] (an inactive member's is ignored)."""
        loss = np.asarray(losses, dtype=float)
        if loss.shape != self.cumulative_loss.shape or not np.all((loss >= 0) & (loss <= 1)):
            raise ValueError(f"losses must be {self.num_members} numbers in [0, 1], got {loss.tolist()}")
        loss = np.where(self.active, loss, 0.0)
        p, eta = self.probabilities(), self.eta()
        played = float(p @ loss)
        if math.isinf(eta):  # the mix loss of following the leaders is the least loss among them
            mix = float(loss[p > 0].min())
        else:  # -1/eta ln sum_i p_i exp(-eta l_i), in log space: p_i may underflow at a large eta
            on = self.active
            log_weights = self._log_prior()[on] - eta * (self.cumulative_loss[on] - self.cumulative_loss[on].min())
            mix = (_log_sum_exp(log_weights) - _log_sum_exp(log_weights - eta * loss[on])) / eta
        self.mixability_gap += max(played - mix, 0.0)
        self.cumulative_loss += loss
        self.rounds += 1

    def learn_bandit(self, index: int, loss: float, probability: float) -> None:
        """A bandit round: the played member's loss, importance-weighted by its probability."""
        if not 0.0 <= loss <= 1.0 or not 0.0 < probability <= 1.0:
            raise ValueError(f"need a loss in [0, 1] and a probability in (0, 1], got {loss} and {probability}")
        if not self.active[index]:
            raise ValueError(f"member {index} cannot run this kind of job, so it cannot have been played")
        self.cumulative_loss[index] += loss / probability
        self.rounds += 1


def job_context(job: Job) -> str:
    """The kind of job a round belongs to: its N_max, deadline slack and reconfiguration overhead.

    Which member suits a job depends on these as much as on the market (a plan that commits to
    a few cheap instances wins with time to spare and loses with a tight deadline), so each kind
    keeps its own weights. The slack is the deadline over the hours N_max instances need
    (overhead included), to the nearest 0.05.
    """
    hours = job.work / job.rate(job.max_instances) + job.reconfig_overhead_hours
    slack = round(job.deadline_hours / hours * 20) / 20
    overhead_minutes = round(job.reconfig_overhead_hours * 60, 1)
    return f"n_max={job.max_instances},slack={slack:g},overhead={overhead_minutes:g}min,slot={job.slot_hours:g}h"


class SelectorPolicy(Policy):
    """Picks a pool member per job with Hedge or EXP3 and delegates the job's slots to it.

    Each kind of job (:func:`job_context`) has its own learner; a kind seen for the first time
    warms up on the history before its submission. A round is one job: :meth:`open_round` draws
    its member (:meth:`decide` opens it itself if none is open), :meth:`close_round` learns from
    its feedback.

    :param pool: members as ``{"policy": name, "params": {...}}``, built with ``make_policy``,
        each with an optional ``"prior"`` weight (default 1; see :class:`ExponentialWeights`)
        (default: :data:`DEFAULT_POOL`).
    :param algorithm: ``"hedge"`` (full-information feedback: every member's counterfactual
        utility) or ``"exp3"`` (bandit feedback: only the played member's).
    :param seed: places the golden-ratio sequence of member draws.
    :param warm_up_rounds: full-information rounds replayed on history before submission when
        the job's kind has seen no round yet (0: none).
    """

    name = "selector"

    def __init__(
        self,
        pool: Sequence[Mapping[str, Any]] | None = None,
        algorithm: str = "hedge",
        seed: int = 0,
        warm_up_rounds: int = DEFAULT_WARM_UP_ROUNDS,
    ) -> None:
        self.pool = _check_pool(DEFAULT_POOL if pool is None else pool)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
        if not _is_count(seed):
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if not _is_count(warm_up_rounds):
            raise ValueError(f"warm_up_rounds must be an integer >= 0, got {warm_up_rounds!r}")
        self.algorithm, self.seed, self.warm_up_rounds = algorithm, int(seed), int(warm_up_rounds)
        self._draws = 0
        self._learners: OrderedDict[str, ExponentialWeights] = OrderedDict()
        self.members = [_build_member(i, entry) for i, entry in enumerate(self.pool)]
        # Separate instances for counterfactual replays, so that a replay never resets the
        # member that is playing the current job.
        self._replayers = [make_policy(e["policy"], e["params"]) for e in self.pool]
        self.labels = tuple(m.label for m in self.members)
        self._single_instance = tuple(m.single_instance for m in self.members)
        duplicates = sorted({label for label in self.labels if self.labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"pool lists the same member twice: {duplicates}; give each member different params")
        # A replay depends on the member, not on its prior weight.
        self._keys = tuple(json.dumps({"policy": e["policy"], "params": e["params"]}, sort_keys=True) for e in self.pool)
        self.priors = np.array([e.get("prior", 1.0) for e in self.pool], dtype=float)
        self._current: Round | None = None
        self._member_ready = False

    # -- the policy interface ------------------------------------------------------------

    def params(self) -> dict[str, Any]:
        return {
            "pool": [dict(e) for e in self.pool],
            "algorithm": self.algorithm,
            "seed": self.seed,
            "warm_up_rounds": self.warm_up_rounds,
        }

    def differences(self, other: SelectorPolicy, names: tuple[str, str] = ("stored", "asked")) -> list[str]:
        """How ``other``'s settings differ from this selector's, one phrase each (empty: the same selector).

        Weights are learnt for one pool and algorithm and draws follow one seed, so a selector with
        other settings is another selector: neither may take the other's rounds. ``names`` name
        this selector and ``other`` in the phrases, e.g. ``pool: members only stored [...], only asked [...]``.
        """
        mine, theirs = names
        differ = [
            f"{name}: {mine} {getattr(self, name)!r}, {theirs} {getattr(other, name)!r}"
            for name in ("algorithm", "seed", "warm_up_rounds")
            if getattr(self, name) != getattr(other, name)
        ]
        if self.labels != other.labels:
            only_mine = [m for m in self.labels if m not in other.labels]
            only_theirs = [m for m in other.labels if m not in self.labels]
            members = f"only {mine} {only_mine}, only {theirs} {only_theirs}" if only_mine or only_theirs else "reordered"
            differ.insert(0, f"pool: members {members}")
        elif not np.allclose(self.priors / self.priors.max(), other.priors / other.priors.max(), rtol=1e-12, atol=0.0):
            differ.insert(0, f"pool: prior weights {mine} {self.priors.tolist()}, {theirs} {other.priors.tolist()}")
        return differ

    @property
    def label(self) -> str:
        """Short: the pool shows as its size and a digest, not as every member's parameters."""
        digest = hashlib.sha1(json.dumps(self.pool, sort_keys=True).encode()).hexdigest()[:8]
        params = {**self.params(), "pool": f"{len(self.pool)}:{digest}"}
        return f"{self.name}(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")"

    def reset(self, job: Job) -> None:
        """A new job is a new round: the member is drawn at its first slot."""
        self.drop_round()

    def decide(self, observation: Observation) -> Allocation:
        """Delegate to this round's member, opening the round on first use if none is open.

        The round opens from ``observation.past`` cut at submission, so that a kind of job with
        no round yet warms up on the history before the job (see :meth:`open_round`).
        """
        played = self._current or self.open_round(observation.job, JobMarket(observation.past, observation.past_offset))
        member = self.members[played.member_index]
        if not self._member_ready:
            member.reset(observation.job)
            self._member_ready = True
        return member.decide(observation)

    def planned(self) -> list[Allocation]:
        return self.members[self._current.member_index].planned() if self._current is not None else []

    # -- rounds --------------------------------------------------------------------------

    def open_round(self, job: Job, history: JobMarket) -> Round:
        """Draw the member of ``job``'s round and keep the round open until it is closed.

        A kind of job with no round yet first warms up on ``history`` (see :meth:`warm_up`),
        reading only the slots before ``history.offset``. Any round still open is dropped.

        :param job: the job the round is for.
        :param history: the market up to the job's submission at ``history.offset``; later
            slots may be present and are not read.
        :return: the round, which :meth:`close_round` takes back with the job's feedback.
        """
        learner = self._learner(job)
        if learner.rounds == 0 and self.warm_up_rounds:
            self.warm_up(history, job)
        number = self._draws
        index, probability = learner.choose(self._draw())
        self.drop_round()
        self._current = Round(index, self.labels[index], probability, number)
        return self._current

    def set_next_draw(self, number: int) -> None:
        """Make the next round draw at ``number`` of the draw sequence, and later rounds after it.

        For a caller that replays a sequence whose rounds it runs apart: the evaluation runs
        each kind of job of a trace on its own selector, at the draws of the whole sequence.

        :param number: a position in the draw sequence, >= 0.
        """
        if not _is_count(number):
            raise ValueError(f"the draw number must be an integer >= 0, got {number!r}")
        self._draws = int(number)

    def close_round(
        self,
        played: Round | None,
        job: Job,
        job_market: JobMarket,
        utilities: Mapping[str, float] | None = None,
        true_throughput: TrueThroughput | None = None,
    ) -> dict[str, float]:
        """Learn from the feedback of ``job``'s round; returns the losses learnt from, by label.

        Hedge learns every member's loss, replaying on ``job_market`` the members ``utilities``
        does not name. EXP3 learns the played member's loss only, importance-weighted, replayed
        if ``utilities`` lacks it. Any open round ends too: feedback comes once the job is over,
        and so are the jobs played since. The next draw comes after the round's own, so that a
        round closed on another copy of the state (:meth:`recorded_round`) is never drawn again.

        :param played: the round, from :meth:`open_round` or :meth:`recorded_round`; ``None``
            (no member played) suits Hedge only, which needs no played member.
        :param job: the job the round was for.
        :param job_market: the realised market of the job, for the members' replays.
        :param utilities: realised utilities by member label, typically the played member's
            (the job's own result: passing it saves one replay).
        :param true_throughput: the throughput the job really ran at, for the replays (see
            :meth:`counterfactual_utilities`); default the declared one.
        :raises ValueError: when ``utilities`` names no pool member, or EXP3 gets no round.
        """
        known = dict(utilities or {})
        unknown = sorted(set(known) - set(self.labels))
        if unknown:
            raise ValueError(f"utilities name no pool member: {unknown}; the members are {list(self.labels)}")
        learner = self._learner(job)
        on_demand = on_demand_cost(job, job_market.market.on_demand_price)
        if self.algorithm == "hedge":
            active = self.counterfactual_utilities(job, job_market, true_throughput, known=known)
            losses = shortfall_losses(active, on_demand)
            learner.learn_full([losses.get(label, 0.0) for label in self.labels])
        else:
            if played is None:
                raise ValueError("exp3 feedback needs the member played this round: run the job through decide first")
            label = played.label
            utility = known[label] if label in known else self._replay(played.member_index, job, job_market, true_throughput)
            losses = {label: normalised_loss(job, utility, on_demand)}
            learner.learn_bandit(played.member_index, losses[label], played.probability)
        if played is not None and played.draw is not None:
            self._draws = max(self._draws, played.draw + 1)
        self.drop_round()
        return losses

    def update(
        self,
        job: Job,
        job_market: JobMarket,
        utilities: Mapping[str, float] | None = None,
        true_throughput: TrueThroughput | None = None,
    ) -> dict[str, float]:
        """Close the open round, the one :meth:`decide` played ``job`` with (see :meth:`close_round`).

        :param job: the job just played.
        :param job_market: the realised market of the job, for the members' replays.
        :param utilities: realised utilities by member label, typically the played member's.
        :param true_throughput: the throughput the job really ran at; default the declared one.
        """
        return self.close_round(self._current, job, job_market, utilities, true_throughput)

    def take_warm_up(self, start: SelectorPolicy, job: Job) -> bool:
        """Take ``start``'s learner for ``job``'s kind if this selector has learnt no round of that kind.

        A run warms a kind up on the selector it started from but closes its round on the freshest
        stored one (selector_store.py). Where the stored one has learnt nothing for the kind (the
        kind is new to it too, or its document was upgraded from version 1), learning the round on
        a blank learner would throw the warm-up away, and the kind, no longer at 0 rounds, would
        never warm up again. A learner another run stored for the kind meanwhile is kept.

        :return: whether the learner was taken.
        :raises ValueError: when ``start`` has other settings (:meth:`differences`: its learners fit another pool).
        """
        if self.differences(start):
            raise ValueError("a learner can only be taken from a selector with the same pool, algorithm, seed and warm-up")
        context = job_context(job)
        if self.rounds_learnt(job) or not start.rounds_learnt(job):
            return False
        self._learners[context] = copy.deepcopy(start._learners[context])
        self._learner(job)  # the most recently played kind now; drops the least recent beyond MAX_CONTEXTS
        return True

    def recorded_round(self, label: str, probability: float, draw: int) -> Round:
        """The round that another copy of this selector opened, from what its run recorded, so
        that the round can be closed on the freshest state.

        :param label: the label of the member that played it.
        :param probability: the probability that member was drawn with.
        :param draw: the round's number in the draw sequence.
        :raises ValueError: when no member has ``label``.
        """
        if label not in self.labels:
            raise ValueError(f"no pool member has the label {label!r}; the members are {list(self.labels)}")
        return Round(self.labels.index(label), label, float(probability), int(draw))

    def drop_round(self) -> None:
        """Forget the open round without learning from it (no feedback will come, or the round
        is closed elsewhere: an online run carries its round and closes it on the stored state)."""
        self._current = None
        self._member_ready = False

    @property
    def current_round(self) -> Round | None:
        """The open round: drawn, no feedback yet (``current`` in the state document)."""
        return self._current

    @property
    def playing(self) -> str | None:
        """The label of the open round's member, once drawn."""
        return None if self._current is None else self._current.label

    # -- reading the weights -------------------------------------------------------------

    def knows(self, job: Job) -> bool:
        """Whether ``job``'s kind has a learner (it counts rounds; reading it changes nothing)."""
        return job_context(job) in self._learners

    def rounds_learnt(self, job: Job) -> int:
        """The rounds ``job``'s kind has learnt from, warm-up included (0 for a kind not known)."""
        learner = self._learners.get(job_context(job))
        return 0 if learner is None else learner.rounds

    def weights(self, job: Job) -> dict[str, float]:
        """The distribution ``job``'s round is drawn from, by the label of each member that can run
        it (the prior for a kind of job not seen yet, before its warm-up); reading it changes nothing."""
        learner = self._learners.get(job_context(job)) or ExponentialWeights(len(self.pool), self.algorithm, prior=self.priors)
        learner.active = self._active(job)
        p = learner.probabilities()
        return {self.labels[i]: float(p[i]) for i in self._active_indices(job)}

    # -- learning ------------------------------------------------------------------------

    def counterfactual_utilities(
        self,
        job: Job,
        job_market: JobMarket,
        true_throughput: TrueThroughput | None = None,
        estimate_throughput: bool = True,
        known: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Every member's utility had it run ``job`` on the realised ``job_market`` (the members
        that can run it: a single-instance member sits out an N_max > 1 job).

        A job that ran slower than declared is replayed at ``true_throughput``, the members seeing
        the declaration and then their own measurements (or, with ``estimate_throughput`` False,
        the declaration alone), as the played member did: replayed otherwise, every other member
        would finish sooner and cheaper than it could have, and the learner would score the
        played member against runs that never could happen.

        ``known`` gives utilities by label that the caller already has from runs of the same
        policies on the same job, market and throughput: those members are not replayed (a
        member is deterministic given them, so its replay would give the same number).
        """
        known = known or {}
        return {
            self.labels[i]: known[self.labels[i]] if self.labels[i] in known
            else self._replay(i, job, job_market, true_throughput, estimate_throughput)
            for i in self._active_indices(job)
        }

    def warm_up(self, history: JobMarket, job: Job, rounds: int | None = None) -> int:
        """Full-information rounds for ``job``'s kind on windows of ``history`` that end at or
        before submission.

        Only the slots before ``history.offset`` are read. Returns the number of rounds learnt;
        it is below ``rounds`` (default: ``warm_up_rounds``) when the history is short.
        """
        rounds = self.warm_up_rounds if rounds is None else rounds
        past = history.market.window(0, history.offset)
        windows = _warm_up_windows(past, job, rounds)
        learner = self._learner(job)
        on_demand = on_demand_cost(job, past.on_demand_price)
        for window_job, window in windows:
            losses = shortfall_losses(self.counterfactual_utilities(window_job, window), on_demand)
            learner.learn_full([losses.get(label, 0.0) for label in self.labels])
        return len(windows)

    def _learner(self, job: Job) -> ExponentialWeights:
        """The learner of ``job``'s kind, created on first use (the least recently used one
        beyond :data:`MAX_CONTEXTS` kinds is dropped)."""
        context = job_context(job)
        if context not in self._learners:
            self._learners[context] = ExponentialWeights(len(self.pool), self.algorithm, self._active(job), self.priors)
        self._learners.move_to_end(context)
        while len(self._learners) > MAX_CONTEXTS:
            self._learners.popitem(last=False)
        learner = self._learners[context]
        learner.active = self._active(job)  # a function of N_max, part of the kind: a restored learner gets it here
        return learner

    def _active(self, job: Job) -> np.ndarray:
        """Which members can run ``job``: all, but a single-instance one only where N_max = 1."""
        return np.array([not single or job.max_instances == 1 for single in self._single_instance])

    def _active_indices(self, job: Job) -> list[int]:
        return np.flatnonzero(self._active(job)).tolist()

    def _draw(self) -> float:
        """The next number of the draw sequence (:func:`golden_draw`), counted."""
        u = golden_draw(self.seed, self._draws)
        self._draws += 1
        return u

    def _replay(
        self,
        index: int,
        job: Job,
        job_market: JobMarket,
        true_throughput: TrueThroughput | None = None,
        estimate_throughput: bool = True,
    ) -> float:
        truth = true_throughput or TrueThroughput()
        key = (
            self._keys[index], json.dumps(job.to_dict(), sort_keys=True), _market_key(job_market), repr(truth), estimate_throughput
        )
        if key in _replay_cache:
            _replay_cache.move_to_end(key)
            return _replay_cache[key]
        utility = simulate(self._replayers[index], job, job_market, truth, estimate_throughput).outcome.utility
        _replay_cache[key] = utility
        if len(_replay_cache) > _REPLAY_CACHE_SIZE:
            _replay_cache.popitem(last=False)
        return utility

    # -- state ---------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The whole learner as a small JSON-serialisable document (see :meth:`from_state`).

        ``contexts`` maps each kind of job, least recently played first, to its cumulative
        losses, rounds and mixability gap (the learning rate follows from them); the draws
        from ``seed`` and ``draws``; ``current`` is the member of an unfinished round.
        """
        current = None
        if self._current is not None:
            current = {"member": self._current.label, "probability": self._current.probability}
        contexts = {
            context: {
                "cumulative_loss": dict(zip(self.labels, learner.cumulative_loss.tolist())),
                "rounds": learner.rounds,
                "mixability_gap": learner.mixability_gap,
            }
            for context, learner in self._learners.items()
        }
        settings = {"version": STATE_VERSION, **self.params()}
        return {**settings, "contexts": contexts, "draws": self._draws, "current": current}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SelectorPolicy:
        """Restore a selector exactly from :meth:`to_state`'s document."""
        if not isinstance(state, Mapping):
            raise SelectorStateError(f"selector state must be a JSON object, got {type(state).__name__}")
        if state.get("version") == 1:
            state = _upgrade_version_1(state)
        if state.get("version") != STATE_VERSION:
            raise SelectorStateError(
                f"selector state field 'version' is {state.get('version')!r}; this code reads version {STATE_VERSION}: "
                "start a fresh selector (delete the stored state) or convert the document"
            )
        settings = ("pool", "algorithm", "seed", "warm_up_rounds")
        fields = ("version", *settings, "contexts", "draws", "current")
        missing = [f for f in fields if f not in state]
        unknown = sorted(set(state) - set(fields))
        if missing or unknown:
            raise SelectorStateError(f"selector state has missing field(s) {missing} and unknown field(s) {unknown}")
        try:
            selector = cls(**{f: state[f] for f in settings})
        except (TypeError, ValueError) as exc:
            raise SelectorStateError(f"selector state: {exc}") from None
        if not _is_count(state["draws"]):
            raise SelectorStateError(f"selector state field 'draws' must be an integer >= 0, got {state['draws']!r}")
        selector._draws = state["draws"]
        contexts = state["contexts"]
        if not isinstance(contexts, Mapping):
            raise SelectorStateError(f"selector state field 'contexts' must be an object of kinds of job, got {contexts!r}")
        for context, learned in contexts.items():
            selector._learners[context] = _read_learner(context, learned, selector.labels, selector.algorithm, selector.priors)
        selector._current = _read_current(state["current"], selector.labels)
        return selector


def golden_draw(seed: int, number: int) -> float:
    """The ``number``-th draw of the golden-ratio sequence from a start that ``seed`` places.

    Every draw is uniform on [0, 1), so each round plays its member with exactly the
    learner's probabilities (what the regret bound needs against a market that ignores our
    draws), while successive draws spread evenly, so the members' shares of a run of jobs
    track their probabilities more closely than independent draws would.
    """
    start = np.random.default_rng(seed).random()
    return (start + number * GOLDEN) % 1.0


def shortfall_losses(utilities: Mapping[str, float], scale: float) -> dict[str, float]:
    """Full-information losses in [0, 1]: each member's shortfall from the round's best, over ``scale``.

    ``scale`` is the job's on-demand cost: a member a whole on-demand bill behind the round's
    best loses 1 (worse is clipped), the best loses 0. Measured against the best rather than
    against the job's value (as :func:`normalised_loss` must, lacking the other members), the
    few percent that separate members are the whole signal, and AdaHedge's rate adapts to their
    size, so no further scale is chosen.
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
    windows: list[tuple[Job, JobMarket]] = []
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


def _check_pool(pool: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    if isinstance(pool, (str, bytes, Mapping)) or not isinstance(pool, Sequence) or not pool:
        raise ValueError('pool must be a non-empty list of {"policy": name, "params": {...}}')
    checked = []
    for i, entry in enumerate(pool):
        if not isinstance(entry, Mapping) or "policy" not in entry or set(entry) - {"policy", "params", "prior"}:
            raise ValueError(f'pool[{i}] must be {{"policy": name, "params": {{...}}, "prior": weight (optional)}}, got {entry!r}')
        params = entry.get("params") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"pool[{i}].params must be an object of parameters, got {params!r}")
        if entry["policy"] == SelectorPolicy.name:
            raise ValueError(f"pool[{i}] is a selector; a pool holds plain policies")
        prior = entry.get("prior", 1)
        if not is_number(prior) or not prior > 0:
            raise ValueError(f"pool[{i}].prior must be a number > 0 (the member's weight before any loss, 1 by default), got {prior!r}")
        # Written only where it is not the default, so a pool without priors keeps its documents and digest.
        checked.append({"policy": entry["policy"], "params": dict(params), **({"prior": prior} if prior != 1 else {})})
    return tuple(checked)


def _build_member(index: int, entry: Mapping[str, Any]) -> Policy:
    try:
        member = make_policy(entry["policy"], entry["params"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"pool[{index}]: {exc}") from None
    if member.uses_future:
        raise ValueError(f"pool[{index}] ({member.label}) sees the future; the selector is an online policy")
    return member


def _read_current(current: Any, labels: Sequence[str]) -> Round | None:
    if current is None:
        return None
    if (
        not isinstance(current, Mapping)
        or current.get("member") not in labels
        or not is_number(current.get("probability"))
        or not 0.0 < current["probability"] <= 1.0
    ):
        raise SelectorStateError(
            f"selector state field 'current' must be null or {{\"member\": one of {list(labels)}, "
            f'"probability": a number in (0, 1]}}, got {current!r}'
        )
    return Round(labels.index(current["member"]), current["member"], float(current["probability"]), None)


def _log_sum_exp(x: np.ndarray) -> float:
    top = float(x.max())
    return top + math.log(float(np.exp(x - top).sum()))


def _upgrade_version_1(state: Mapping[str, Any]) -> dict[str, Any]:
    """A version-2 document from a version-1 one: same pool, settings and draws, nothing learnt.

    Version 1 kept one set of weights for every kind of job, on another loss scale; they do not
    split into kinds, so each kind warms up on history again, as a fresh selector would.
    """
    logger.warning(
        "selector state version 1 upgraded to version 2: its weights (one set for every kind of job) are not "
        "carried over; each kind of job warms up on the market's history on its next run"
    )
    settings = {key: state[key] for key in ("pool", "algorithm", "seed", "warm_up_rounds", "draws") if key in state}
    return {"version": STATE_VERSION, **settings, "contexts": {}, "current": None}


def _read_learner(context: str, learned: Any, labels: Sequence[str], algorithm: str, prior: np.ndarray) -> ExponentialWeights:
    where = f"selector state field 'contexts' entry {context!r}"
    if not isinstance(learned, Mapping) or sorted(learned) != ["cumulative_loss", "mixability_gap", "rounds"]:
        raise SelectorStateError(f"{where} must hold exactly cumulative_loss, rounds and mixability_gap; got {learned!r}")
    losses = learned["cumulative_loss"]
    if not isinstance(losses, Mapping) or sorted(losses) != sorted(labels):
        raise SelectorStateError(
            f"{where}: 'cumulative_loss' must map exactly the pool's members {list(labels)} to numbers; "
            f"got keys {sorted(losses) if isinstance(losses, Mapping) else losses!r}"
        )
    values = [losses[label] for label in labels]
    if not all(is_number(v) and v >= 0 for v in values):
        raise SelectorStateError(f"{where}: 'cumulative_loss' holds a value that is not a finite number >= 0: {values}")
    if not _is_count(learned["rounds"]):
        raise SelectorStateError(f"{where}: 'rounds' must be an integer >= 0, got {learned['rounds']!r}")
    if not (is_number(learned["mixability_gap"]) and learned["mixability_gap"] >= 0):
        raise SelectorStateError(f"{where}: 'mixability_gap' must be a number >= 0, got {learned['mixability_gap']!r}")
    learner = ExponentialWeights(len(labels), algorithm, prior=prior)
    learner.cumulative_loss = np.asarray(values, dtype=float)
    learner.rounds = learned["rounds"]
    learner.mixability_gap = float(learned["mixability_gap"])
    return learner


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 0)  # np.bool_ for numpy ints


