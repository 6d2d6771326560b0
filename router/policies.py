"""The four routing policies, as pure functions of the replicas' state and the request's block chain.

- ``roundRobin``: in turn;
- ``leastLoaded``: fewest running + waiting (the replica's /metrics) + requests the router has in flight there;
- ``prefix``: the longest prefix of the request's chain cached on a replica's *device*, among replicas whose
  load is within ``load_slack`` of the least loaded; least loaded when no replica holds any of it;
- ``tierAware``: the lowest estimated time to have the prompt's KV ready: missing tokens / prefill rate +
  host blocks x block size / host load rate + disk blocks x block size / disk load rate (device blocks are
  free), with each replica's measured rates, among the same load-bounded replicas; costs within 25% of the
  best are a tie.

Ties go to the least loaded, then in turn, so equal replicas share the work. A cache policy's decision says
``load_bound`` when a replica beyond the load bound would have served the request cheaper (a longer prefix,
a lower cost): the cache hit was given up for the queue.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.router.index import BlockIndex

# Used until a replica has measured its own rates (tokens per second): CPU-class figures, and only their
# ratios matter for the choice.
DEFAULT_PREFILL_TPS = 2000.0
DEFAULT_LOAD_TPS = {"host": 100_000.0, "disk": 20_000.0}
# Costs within 25% of the best count as equal (then the least loaded wins): measured rates are noisy, and
# without this a cold request would always go to the replica that happened to measure fastest.
COST_TIE = 1.25


@dataclass
class Candidate:
    """What a policy sees of one healthy replica."""

    name: str
    load: int = 0  # running + waiting (scraped) + in flight through this router
    index: BlockIndex = field(default_factory=BlockIndex)
    block_size: int = 16
    prefill_tps: float | None = None
    load_tps: dict[str, float] = field(default_factory=dict)


@dataclass
class Decision:
    name: str
    reason: str  # round_robin | least_loaded | prefix_hit | device_hit | tier_hit | no_prefix | load_bound | single
    predicted_cached_tokens: int = 0
    tiers: dict[str, int] = field(default_factory=dict)  # predicted cached blocks per tier
    cost_s: float | None = None


def steady_rates(cands: Sequence[Candidate]) -> None:
    """Clamp each replica's measured prefill rate to within 2x of the replicas' median, and give a replica
    that has measured none the median: one noisy measurement (a short step on a busy machine) must not
    outweigh a cached prefix, nor must the default rate of a replica that has not prefilled yet. Replicas
    of one deployment run the same model on the same hardware, so a real difference beyond 2x is rare."""
    rates = sorted(c.prefill_tps for c in cands if c.prefill_tps)
    if not rates:
        return
    median = rates[len(rates) // 2]
    for c in cands:
        c.prefill_tps = min(max(c.prefill_tps, median / 2), median * 2) if c.prefill_tps else median


class Router:
    """Keeps the round-robin cursor; ``choose`` is called once per request (retries exclude replicas)."""

    def __init__(self, policy: str, load_slack: int = 2) -> None:
        self.policy = policy
        self.load_slack = load_slack
        self._rr = itertools.count()

    def choose(self, cands: Sequence[Candidate], chain: Sequence[str], num_tokens: int) -> Decision:
        if not cands:
            raise LookupError("no healthy replica")
        if len(cands) == 1:
            return self._decide(cands[0], "single", chain, num_tokens)
        if self.policy == "roundRobin":
            return self._decide(cands[next(self._rr) % len(cands)], "round_robin", chain, num_tokens)
        if self.policy == "leastLoaded":
            return self._decide(self._least_loaded(cands), "least_loaded", chain, num_tokens)
        bounded = self._bounded(cands)
        if self.policy == "prefix":
            d, longest = self._prefix(bounded, chain, num_tokens)
            if len(bounded) < len(cands):
                beyond = [c for c in cands if c not in bounded]
                if max(len(self._held(c, chain, num_tokens, device_only=True)) for c in beyond) > longest:
                    d.reason = "load_bound"
            return d
        steady_rates(cands)
        d = self._tier_aware(bounded, chain, num_tokens)
        if len(bounded) < len(cands) and d.cost_s is not None:
            if min(self.cost(c, chain, num_tokens)[0] for c in cands) * COST_TIE < d.cost_s:
                d.reason = "load_bound"
        return d

    # -- helpers -------------------------------------------------------------------------------------------
    def _least_loaded(self, cands: Sequence[Candidate]) -> Candidate:
        low = min(c.load for c in cands)
        ties = [c for c in cands if c.load == low]
        return ties[next(self._rr) % len(ties)]

    def _bounded(self, cands: Sequence[Candidate]) -> list[Candidate]:
        low = min(c.load for c in cands)
        return [c for c in cands if c.load <= low + self.load_slack]

    @staticmethod
    def _held(c: Candidate, chain: Sequence[str], num_tokens: int, device_only: bool) -> list[str]:
        usable = max(0, (num_tokens - 1) // c.block_size)  # the engine always computes the last token
        return c.index.prefix_tiers(chain[:usable], device_only=device_only)

    def _decide(self, c: Candidate, reason: str, chain: Sequence[str], num_tokens: int) -> Decision:
        held = self._held(c, chain, num_tokens, device_only=False)
        tiers = {t: held.count(t) for t in set(held)}
        return Decision(c.name, reason, len(held) * c.block_size, tiers)

    def _prefix(self, cands: list[Candidate], chain: Sequence[str], num_tokens: int) -> tuple[Decision, int]:
        """The decision, and the longest device prefix (blocks) it found."""
        scored = [(len(self._held(c, chain, num_tokens, device_only=True)), c) for c in cands]
        best = max(n for n, _ in scored)
        if best == 0:
            return self._decide(self._least_loaded(cands), "no_prefix", chain, num_tokens), 0
        ties = [c for n, c in scored if n == best]
        return self._decide(self._least_loaded(ties), "prefix_hit", chain, num_tokens), best

    def cost(self, c: Candidate, chain: Sequence[str], num_tokens: int) -> tuple[float, list[str]]:
        """Seconds to have the prompt's KV on the device at ``c``, and the tiers of its cached prefix."""
        held = self._held(c, chain, num_tokens, device_only=False)
        prefill = c.prefill_tps or DEFAULT_PREFILL_TPS
        missing = max(0, num_tokens - len(held) * c.block_size)
        seconds = missing / prefill
        for tier in ("host", "disk"):
            n = held.count(tier)
            if n:
                rate = c.load_tps.get(tier) or DEFAULT_LOAD_TPS[tier]
                seconds += n * c.block_size / rate
        return seconds, held

    def _tier_aware(self, cands: list[Candidate], chain: Sequence[str], num_tokens: int) -> Decision:
        scored = [(*self.cost(c, chain, num_tokens), c) for c in cands]
        best = min(s for s, _, _ in scored)
        ties = [c for s, _, c in scored if s <= best * COST_TIE + 1e-9]
        c = self._least_loaded(ties)
        held = next(h for _, h, x in scored if x is c)
        if not held:
            reason = "no_prefix"
        elif all(t == "device" for t in held):
            reason = "device_hit"
        else:
            reason = "tier_hit"
        tiers = {t: held.count(t) for t in set(held)}
        return Decision(c.name, reason, len(held) * c.block_size, tiers, best)
