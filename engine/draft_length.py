"""How many tokens to draft a step: the k in 0..max whose expected tokens per second is highest, from the
acceptance measured at each draft position and the step times measured for each k at the step's batch size.

A verify step of n requests with k drafts each gives each request 1 + a1 + a1*a2 + ... + a1*...*ak tokens (a_j:
the chance draft j is accepted once the ones before it were) and takes T(n, k); with k = 0 nothing is drafted or
verified and a step gives one token in T(n, 0). The verify's k + 1 positions cost more than one where the step
reads more than its weights (the experts of k + 1 positions under hybrid offload, a batch past the GPU's
bandwidth-bound size), so the best k is measured, not assumed: each k's time is a moving average of the
decode steps that ran it, per batch-size bucket (powers of two). A k not yet timed at a bucket is run first, and
every `explore_every` steps another k than the best runs once, so neither its time nor the acceptance goes stale.
"""

from __future__ import annotations

TIME_DECAY = 0.9  # weight of the average so far against a new step's time
PRIOR = 1, 2  # acceptance before any verdict: (accepted + 1) / (tried + 2), a uniform prior


class DraftLength:
    def __init__(self, most: int, explore_every: int = 32) -> None:
        """`most`: the largest k (the engine's speculative_tokens)."""
        self.most, self.explore_every = most, explore_every
        self.times: dict[tuple[int, int], float] = {}  # (batch bucket, k) -> seconds a step
        self.tried = [0] * most  # per draft position: drafts verified there
        self.accepted = [0] * most  # and of those, accepted
        self._steps = 0

    @staticmethod
    def bucket(batch: int) -> int:
        return max(batch, 1).bit_length()

    def acceptance(self, position: int) -> float:
        """The chance draft `position` (1-based) is accepted once the ones before it were."""
        return (self.accepted[position - 1] + PRIOR[0]) / (self.tried[position - 1] + PRIOR[1])

    def expected_tokens(self, k: int) -> float:
        """Tokens a request gets from a step with k drafts."""
        total, reach = 1.0, 1.0
        for position in range(1, k + 1):
            reach *= self.acceptance(position)
            total += reach
        return total

    def choose(self, batch: int) -> int:
        """The k for the next step of `batch` decoding requests."""
        self._steps += 1
        bucket = self.bucket(batch)
        untimed = [k for k in range(self.most, -1, -1) if (bucket, k) not in self.times]
        if untimed:
            return untimed[0]
        rates = {k: self.expected_tokens(k) / self.times[bucket, k] for k in range(self.most + 1)}
        best = max(rates, key=lambda k: (rates[k], -k))
        if self._steps % self.explore_every == 0:  # the others in turn, one step each
            others = [k for k in range(self.most + 1) if k != best]
            return others[(self._steps // self.explore_every) % len(others)]
        return best

    def timed(self, batch: int, k: int, seconds: float) -> None:
        """A decode step of `batch` requests that each verified k drafts (0: none) took `seconds`."""
        key = self.bucket(batch), k
        self.times[key] = seconds if key not in self.times else \
            TIME_DECAY * self.times[key] + (1 - TIME_DECAY) * seconds

    def verdict(self, drafts: int, accepted: int) -> None:
        """A request verified `drafts` drafts and accepted the first `accepted`: positions up to the first
        rejected one were tried."""
        for position in range(min(accepted + 1, drafts)):
            self.tried[position] += 1
            self.accepted[position] += position < accepted
