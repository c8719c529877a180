"""How many tokens each sequence drafts: chosen every step from measurements, not fixed.

A step that verifies k drafts of a sequence emits one token plus the accepted prefix of its
drafts. With a_j the measured probability that draft j is accepted once drafts 1 .. j-1 were, the
step emits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k tokens on average. It costs the forward of
the step's rows (a verify of k + 1 rows costs more than a decode step of one) plus proposing the
k drafts (an MTP block's steps; next to nothing for n-gram lookup). Both costs are measured on
this machine as it runs (`StepCosts`: per row count of a step and per draft count, moving
averages), the acceptance per sequence (`Acceptance`), and `plan_drafts` gives every sequence of
a step the k (0 .. its most) that maximises the step's expected tokens per second: k = 0, plain
decoding, wherever drafting does not pay (and a sequence at k = 0 is planned again only every
`REPLAN` steps: on a small model the plan's own time shows). Under load a verify's rows join the step's other rows,
so what one more draft costs is the step's cost at one more row.

A step one row larger than any measured is taken to cost what the largest measured one did, so it
is tried, and then measured; larger ones cost in proportion to their rows until measured, so the
sizes are explored one row at a time. A sequence that has not drafted for `PROBE_EVERY` steps drafts one
token, so its acceptance follows the text; each probe after which it still does not draft
doubles that wait (up to `PROBE_MAX`), so where drafting does not pay, probing costs little, and
a probe waits for a step where one more row and its draft cost no more than the step's average
row.
Drafts change only speed, never a token (speculative.py), so none of this can change an output.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

SMOOTHING = 0.25  # weight of a new timing in a moving average
PROBE_EVERY = 32  # steps without drafts after which a sequence drafts one token, to measure again
PROBE_MAX = 512  # the longest such wait
REPLAN = 8  # a sequence that is not drafting is planned again every REPLAN steps (the plan costs time too)
MEMORY = 64  # acceptance counts are halved past this many verified first drafts: recent text counts more


@dataclass
class StepCosts:
    """Measured seconds of a step's forward by its row count, and of proposing k drafts."""

    forward: dict[int, float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def _add(table: dict[int, float], key: int, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else old + SMOOTHING * (seconds - old)

    def record_forward(self, rows: int, seconds: float) -> None:
        self._add(self.forward, rows, seconds)

    def record_draft(self, k: int, seconds: float) -> None:
        if k > 0:
            self._add(self.draft, k, seconds)


    def forward_seconds(self, rows: int) -> float | None:
        """The measured cost of a step of `rows` rows; unmeasured: linear between the measured
        sizes around it, and past the largest one what that one cost for one more row (so the
        next size is tried, then measured) and in proportion to the rows beyond; None when
        nothing is measured."""
        t = self.forward
        if rows in t or not t:
            return t.get(rows)
        below = max((r for r in t if r < rows), default=None)
        above = min((r for r in t if r > rows), default=None)
        if below is None:
            return t[above] * rows / above
        if above is None:
            return t[below] if rows == below + 1 else t[below] * rows / below
        return t[below] + (t[above] - t[below]) * (rows - below) / (above - below)

    def draft_seconds(self, k: int) -> float:
        """The measured cost of proposing k drafts; unmeasured: the nearest smaller k's (tried,
        then measured), else 0."""
        if k <= 0:
            return 0.0
        known = [j for j in self.draft if j <= k]
        return self.draft[max(known)] if known else 0.0


class Acceptance:
    """One sequence's drafts: how often draft j was accepted once drafts 1 .. j-1 were."""

    def __init__(self, max_draft: int):
        self.reached = [0.0] * max_draft  # verifies in which draft j was drafted and 1 .. j-1 accepted
        self.kept = [0.0] * max_draft  # ... and j was accepted too
        self.idle = 0  # steps since this sequence last drafted
        self.probe_every = PROBE_EVERY  # idle steps before a probe (doubles while probes do not pay)

    def copy(self) -> "Acceptance":
        """A new sequence's start: these counts (not the idle steps of whoever kept them)."""
        new = Acceptance(len(self.reached))
        new.reached, new.kept = list(self.reached), list(self.kept)
        return new

    def record(self, drafted: int, accepted: int) -> None:
        """A step drafted `drafted` tokens and `accepted` of them were accepted (a prefix)."""
        if drafted == 0:
            self.idle += 1
            return
        self.idle = 0
        for j in range(min(accepted + 1, drafted)):
            self.reached[j] += 1
            self.kept[j] += j < accepted
        if self.reached[0] > MEMORY:
            self.reached = [r / 2 for r in self.reached]
            self.kept = [k / 2 for k in self.kept]

    def rate(self, j: int) -> float:
        """a_{j+1}: the chance draft j (from 0) is accepted once the ones before it were; one
        accepted out of two until measured."""
        return (self.kept[j] + 1) / (self.reached[j] + 2)

    def reach(self, k: int) -> list[float]:
        """[a_1, a_1 a_2, ..., a_1 ... a_k]: the chance each of the first k drafts is emitted."""
        out, p = [], 1.0
        for j in range(min(k, len(self.reached))):
            p *= self.rate(j)
            out.append(p)
        return out


def plan_drafts(seqs: list[tuple[Acceptance, int]], costs: StepCosts, other_rows: int = 0) -> list[int]:
    """Each sequence's draft count for one step: (its Acceptance, the most it may draft) in,
    k in 0 .. that most out, maximising the step's expected tokens per second. `other_rows`: the
    step's other decode rows (sequences that do not draft: a token each). Greedy: add to one
    sequence at a time the run of drafts that raises the step's rate most, while one does. No
    drafts until a plain step has been measured."""
    ks = [0] * len(seqs)
    # a sequence at k = 0 is planned again every REPLAN steps, or when a probe is due
    due = [i for i, (acc, most) in enumerate(seqs)
           if most > 0 and not (0 < acc.idle < acc.probe_every and acc.idle % REPLAN)]
    if not due:
        return ks
    rows = other_rows + len(seqs)
    base = costs.forward_seconds(rows)
    if base is None:
        return ks
    reach = {i: seqs[i][0].reach(seqs[i][1]) for i in due}
    tokens, drafting = float(rows), 0.0
    rate = tokens / base
    while True:
        best = None
        for i in due:
            most = seqs[i][1]
            for extra in range(1, most - ks[i] + 1):
                gain = sum(reach[i][ks[i]:ks[i] + extra])
                spent = drafting - costs.draft_seconds(ks[i]) + costs.draft_seconds(ks[i] + extra)
                r = (tokens + gain) / (costs.forward_seconds(rows + extra) + spent)
                if r > rate and (best is None or r > best[0]):
                    best = (r, i, extra, gain, spent)
        if best is None:
            break
        rate, i, extra, gain, drafting = best
        ks[i] += extra
        rows += extra
        tokens += gain
    for i in due:
        acc = seqs[i][0]
        if ks[i] > 0:
            acc.probe_every = PROBE_EVERY
        elif acc.idle >= acc.probe_every and _row_is_cheap(costs, rows):
            ks[i] = 1
            rows += 1
            acc.probe_every = min(2 * acc.probe_every, PROBE_MAX)
    return ks


def _row_is_cheap(costs: StepCosts, rows: int) -> bool:
    """Whether one more row, and proposing its draft, cost a step of `rows` no more than its rows
    cost on average: a probe waits for such a step (past a kernel's row limit one more row can
    cost half a step; an MTP draft after a long idle run first runs the MTP block over what it
    missed)."""
    now, more = costs.forward_seconds(rows), costs.forward_seconds(rows + 1)
    return now is not None and more is not None and more - now + costs.draft_seconds(1) <= now / rows


_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def shared_costs(model, *key) -> StepCosts:
    """The StepCosts of `model` under `key` (its thread count, its mode), kept as long as the
    model is: each generate call starts from what the earlier ones measured."""
    return _SHARED.setdefault(model, {}).setdefault(("costs", *key), StepCosts())


def shared_acceptance(model, drafter: str, max_draft: int) -> Acceptance:
    """The Acceptance of `model`'s `drafter` kind (and most drafts) across generate calls: a call
    starts from what the earlier ones measured (their probes' back-off included), not from the
    prior, since a drafter's acceptance is mostly the model's."""
    return _SHARED.setdefault(model, {}).setdefault(("acceptance", drafter, max_draft), Acceptance(max_draft))
