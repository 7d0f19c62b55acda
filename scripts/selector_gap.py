"""Where the selector's gap to the optimum is, from an evaluation's results (run with `selector`
and `optimal`): per trace, its expected excess cost, the best member per kind of job in
hindsight, and the best member per job in hindsight; beside them, what playing each job's most
likely member (the highest weight, no draw) would have paid, and the best single member for every
job of the trace (what a selector must beat to be worth its rounds).

The selector learns one distribution per kind of job, so the best it can approach is the best
member per kind: the distance from its expected cost to that figure is the selection's part of
the gap, the rest of the way to the optimum is the members'. The best member per job is what a
selector with perfect context (beyond the kind) could reach at most. The best member per start
time (one member for every kind of job submitted at that time) tells whether the market at
submission, on its own, points to one member. The best member per kind is chosen on the very jobs
it is scored on, the minimum of several noisy means over a few rounds; `per kind, held out` plays
for each job the member best on the same kind's other jobs of the trace (later ones included), the
most a choice per kind could reach on evidence it could have: a selector near it has little left
to gain from its selection. The most likely member
shows what the draw's randomness costs or saves: a selector that always played it would have no
regret bound (a deterministic choice can be led astray round after round), so it is a check on
the draws, not an alternative. Plain script:

    python scripts/selector_gap.py results/eval            # the folder `spotsched evaluate --out` wrote
    python scripts/selector_gap.py results/eval --nmax 1   # the N_max = 1 jobs only
    python scripts/selector_gap.py results/eval --members  # and each member's own mean, a line each
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

SCENARIO = ("trace", "start", "n_max", "slack", "overhead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="folder written by `spotsched evaluate --out`")
    parser.add_argument("--nmax", type=int, nargs="+", help="only the jobs with these N_max (default: all)")
    parser.add_argument("--members", action="store_true", help="also print each member's mean excess cost per trace")
    args = parser.parse_args()
    with (args.results / "results.csv").open(newline="") as handle:
        optimal = {tuple(r[k] for k in SCENARIO): r for r in csv.DictReader(handle) if r["policy"] == "optimal"}
    learning = json.loads((args.results / "results.json").read_text())["selector"]
    if not optimal or not learning:
        raise SystemExit(f"{args.results} holds no optimal runs or no selector learning; evaluate with both policies")
    print(f"{'trace':<32} {'jobs':>5} {'expected':>9} {'best per kind':>14} {'best per job':>13} {'best per start':>15}"
          f" {'per kind, held out':>19} {'most likely':>12} {'best member':>12}")
    for trace, record in learning.items():
        expected, best_job, most_likely = [], [], []
        per_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        jobs_of_kind: dict[str, list[dict[str, float]]] = defaultdict(list)
        per_start: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        per_member: dict[str, float] = defaultdict(float)
        for play in record["plays"]:
            if args.nmax and play["n_max"] not in args.nmax:
                continue
            reference = optimal[(trace, play["start"], *(str(play[k]) for k in SCENARIO[2:]))]
            cost, utility = float(reference["cost"]), float(reference["utility"])
            excess = {member: (utility - u) / cost for member, u in play["utilities"].items()}
            probabilities = play["probabilities"]
            expected.append(sum(p * excess[member] for member, p in probabilities.items()))
            best_job.append(min(excess.values()))
            most_likely.append(excess[max(probabilities, key=probabilities.get)])
            jobs_of_kind[play["context"]].append(excess)
            for member, value in excess.items():
                per_kind[play["context"]][member] += value
                per_start[play["start"]][member] += value
                per_member[member] += value
        n = len(expected)
        best_kind = sum(min(totals.values()) for totals in per_kind.values()) / n
        best_start = sum(min(totals.values()) for totals in per_start.values()) / n
        held_out = sum(
            job[min(job, key=lambda member: per_kind[kind][member] - job[member])]
            for kind, jobs in jobs_of_kind.items()
            for job in jobs
        ) / n
        print(
            f"{trace:<32} {n:>5} {100 * sum(expected) / n:>+8.1f}% {100 * best_kind:>+13.1f}% {100 * sum(best_job) / n:>+12.1f}%"
            f" {100 * best_start:>+14.1f}% {100 * held_out:>+18.1f}% {100 * sum(most_likely) / n:>+11.1f}%"
            f" {100 * min(per_member.values()) / n:>+11.1f}%"
        )
        if args.members:
            for member, total in sorted(per_member.items(), key=lambda item: item[1]):
                print(f"    {100 * total / n:>+6.1f}%  {member}")


if __name__ == "__main__":
    main()
