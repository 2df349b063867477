"""The CPU's token budgets: how many prompt tokens a step may compute beside
running decodes, measured from the model's cost at start-up (cpu_token_budgets)
and kept to its bound while serving (ChunkTuner)."""

from __future__ import annotations

from collections.abc import Callable

# A prompt chunk adds at most ITL_BOUND - 1 decode steps to a step with decodes;
# a prompt-only step reads the weights for at most 1 / PREFILL_READ_SHARE of its
# time. Measured with prompts of 1 and CPU_BUDGET_PROBE_TOKENS in turn,
# CPU_BUDGET_PROBE_ROUNDS times; kept within CPU_BUDGET_RANGE, and while serving
# (ChunkTuner) within [CHUNK_MIN, the budget].
ITL_BOUND = 3
PREFILL_READ_SHARE = 8
CPU_BUDGET_PROBE_TOKENS = 32
CPU_BUDGET_PROBE_ROUNDS = 4
CPU_BUDGET_RANGE = (16, 2048)
CHUNK_MIN = 4

def cpu_token_budgets(cost: Callable[[int], float], max_num_seqs: int,
                      max_tokens: int = CPU_BUDGET_RANGE[1]) -> tuple[int, int, float, float]:
    """(max_num_batched_tokens, prompt tokens per step with decodes, t1, c)
    from ``cost(n)``: the seconds one n-token forward takes (n <= ``max_tokens``,
    the model's positions).

    A step costs about t1 (one token: reading the weights) plus c per further
    token (compute). A prompt chunk delays every decoding stream by its cost,
    so in steps with decodes prompts get (ITL_BOUND - 1) t1 / c tokens: a step
    costs at most the decodes plus ITL_BOUND - 1 single-stream steps. Steps
    with only prompts delay nobody; their budget makes reading the weights at
    most 1 / PREFILL_READ_SHARE of the step, and the total leaves room for
    every sequence to decode beside a capped chunk. A fixed chunk tuned on a
    small model stalls every stream of a larger one.

    A neighbour's burst during the probes skews them: 1-token probes slowed
    while a longer one ran quiet once read c as ~0 and gave the largest chunk,
    which stalled every stream. So the two sizes alternate (each keeps its
    quickest run), a longer probe is never taken as quicker than a 1-token one,
    and the chunk found is run once: costing more than half again what c
    predicts, its own time gives c.
    """
    probe = CPU_BUDGET_PROBE_TOKENS
    # First calls (thread team, allocator, weights' first touch) are not the model's cost.
    cost(1), cost(probe)
    t1 = tp = float("inf")
    for _ in range(CPU_BUDGET_PROBE_ROUNDS):
        t1, tp = min(t1, cost(1)), min(tp, cost(probe))
    t1 = min(t1, tp)
    lo, hi = CPU_BUDGET_RANGE

    def chunk(per_token: float) -> int:
        return min(max(int((ITL_BOUND - 1) * t1 / max(per_token, 1e-9)), lo), hi)

    per_token = (tp - t1) / (probe - 1)
    with_decodes = chunk(per_token)
    n = min(with_decodes, max_tokens)
    if n > probe:
        extra = cost(n) - t1
        if extra > 1.5 * (n - 1) * per_token:
            per_token = extra / (n - 1)
            with_decodes = chunk(per_token)
    prompt_only = int(1 + PREFILL_READ_SHARE * t1 / max(per_token, 1e-9))
    total = min(max(prompt_only, max_num_seqs + with_decodes), hi)
    return total, with_decodes, t1, per_token


class ChunkTuner:
    """The prompt tokens a step with decodes may compute, kept to the bound by
    the steps' own times: a step with decodes and a prompt chunk should take
    at most ITL_BOUND x a step of the decodes alone.

    The start-up probe prices a chunk from position 0 on the per-op path. A
    chunk deep in a long prompt also attends to every key before it, and a
    decode beside it leaves the one-call decode step: such a step costs far
    more than the probe predicts. So each mixed step's time above the
    decodes' (an average of decode-only steps with as many decodes) prices
    its prompt tokens again, and the cap moves half way to what the bound
    allows at that price.

    A count of decodes never timed alone (under a steady load a prompt is
    always waiting, so the decode-only steps seen may have other counts, or
    none) is priced from the probe: a 1-token step plus ``per_token`` a further
    row, scaled to the nearest count timed. Priced as the 1-token step, many
    streams' decodes read as the prompt's cost, and the cap fell to a few
    tokens, starving the prompts. O(1) per step, or O(counts timed) for one
    never timed.
    """

    def __init__(self, cap: int, decode_s: float, most: int, per_token: float = 0.0) -> None:
        self.cap = cap
        self.first_decode_s = decode_s  # the probe's 1-token step
        self.per_token = per_token  # the probe's price of a further token
        self.decode_s: dict[int, float] = {}  # decode-only steps' time by their decodes, averaged
        self.most = most

    def _probe_s(self, decodes: int) -> float:
        return self.first_decode_s + (decodes - 1) * self.per_token

    def decodes_alone_s(self, decodes: int) -> float:
        """What a step of ``decodes`` decodes alone takes: as timed, else the probe's
        estimate scaled by the nearest count timed (the probe's, with none)."""
        timed = self.decode_s.get(decodes)
        if timed is not None:
            return timed
        if not self.decode_s:
            return self._probe_s(decodes)
        near = min(self.decode_s, key=lambda d: abs(d - decodes))
        return self.decode_s[near] * self._probe_s(decodes) / self._probe_s(near)

    def observe(self, seconds: float, decodes: int, prompt_tokens: int) -> int:
        """Account one step; the cap for the next.

        Only a chunk of at least half the cap prices tokens: a prompt's last
        token or two cost about nothing beside the decodes, and read as free
        they sent the cap to the whole budget. The cap at most doubles a step.
        """
        if decodes and not prompt_tokens:
            last = self.decode_s.get(decodes, seconds)
            self.decode_s[decodes] = last + 0.2 * (seconds - last)
        elif decodes and prompt_tokens >= self.cap / 2:
            base = self.decodes_alone_s(decodes)
            extra = max(seconds - base, 0.05 * base)
            allowed = prompt_tokens * (ITL_BOUND - 1) * base / extra
            self.cap = min(max(round((self.cap + allowed) / 2), CHUNK_MIN), 2 * self.cap,
                           self.most)
        return self.cap
