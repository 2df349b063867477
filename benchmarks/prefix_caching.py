"""Time to first token on a prefix-cache hit vs a miss.

Workload: a ~1,000-token system prompt + a short question, through the model's
chat template, on the default model. Requests are sent one after another, each
a fresh request with the same system prompt and a different question: the
first one prefills everything; the second and later ones find the system
prompt's full blocks in the cache and prefill only the question. Baseline,
measured in the same run: the same sequence with prefix caching disabled.
Both with a per-step token budget large enough for the whole prompt in one
step (--max-num-batched-tokens, default 2048) and with the engine's default
budget (512 on CPU: the miss takes several steps). Target: >= 5x lower TTFT on
a hit than on the first request and than with caching disabled.

    .venv/bin/python benchmarks/prefix_caching.py [--system-tokens 1000] [--requests 6]
"""

from __future__ import annotations

import argparse
import gc
import statistics

from common import set_threads

from tandem import LLM, SamplingParams

TOPICS = [
    ("shipping", "Orders over fifty dollars ship for free; smaller orders pay a flat fee of six "
     "dollars, and express delivery costs fifteen dollars more."),
    ("returns", "Unworn items may be returned within sixty days for a full refund to the "
     "original payment method, with a prepaid label in the parcel."),
    ("exchanges", "Worn boots can be exchanged once within thirty days if they do not fit, as "
     "long as the soles show no damage."),
    ("warranty", "Tents carry a two-year warranty against manufacturing defects and sleeping "
     "bags a one-year warranty; misuse and normal wear are not covered."),
    ("repairs", "Repairs of tents and jackets cost a flat twenty dollars plus parts and take "
     "about two weeks, and customers are told the price before any work starts."),
    ("shops", "The Portland and Denver shops open from nine to seven on weekdays and from ten "
     "to five on Saturdays, and are closed on Sundays and public holidays."),
    ("gift cards", "Gift cards never expire, can be combined with each other, and work online "
     "and in both shops, but they cannot be exchanged for cash."),
    ("membership", "Trail Club members get ten percent off every order, early access to the "
     "spring sale and free express delivery twice a year; joining is free."),
    ("privacy", "Customer data is used only to process orders and is never sold; customers may "
     "ask for a copy of their data or for its deletion at any time."),
    ("escalation", "If a question is not covered here, ask the customer to write to "
     "help@northwind.example; a person replies within one working day."),
]
QUESTIONS = [
    "How much is shipping for a $30 order?",
    "Can I return boots I wore once?",
    "When is the Denver shop open on Saturday?",
    "Do gift cards expire?",
    "What warranty comes with a tent?",
    "How long does a jacket repair take?",
    "Is the Trail Club free to join?",
    "Who do I contact about a lost parcel?",
    "Can I exchange boots that do not fit?",
    "Are you open on Sundays?",
    "Do you sell my data?",
    "What does express delivery cost?",
]


def system_prompt(tokenizer, target_tokens: int) -> str:
    """A support handbook of about target_tokens tokens (whole sentences)."""
    parts = ["You are Quill, the support assistant of Northwind Outfitters, a small company "
             "that sells hiking boots, tents, sleeping bags and rain jackets. Answer in one or "
             "two short sentences, politely and precisely, using only the handbook below."]
    i = 0
    while len(tokenizer.encode(" ".join(parts))) < target_tokens:
        name, text = TOPICS[i % len(TOPICS)]
        parts.append(f"Section {i + 1} ({name}, revision {i // len(TOPICS) + 1}): {text}")
        i += 1
    return " ".join(parts)


def run(caching: bool, budget: int | None, system: str, n: int, threads: int) -> list:
    llm = LLM(kv_cache_memory="512MiB", enable_prefix_caching=caching, num_threads=threads,
              max_num_batched_tokens=budget)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([tok.encode("Warm-up: the quick brown fox")], params)
    outs = []
    for q in QUESTIONS[:n]:
        ids = tok.apply_chat_template([{"role": "system", "content": system},
                                       {"role": "user", "content": q}])
        outs.append(llm.generate([ids], params)[0])  # one at a time: nothing queues
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and all(b.ref_cnt == 0 for b in kv.blocks)
    assert kv.prefix_cache_hits == sum(o.metrics.num_cached_tokens for o in outs)
    budget_used = llm.engine.max_num_batched_tokens
    del llm
    gc.collect()
    return outs, budget_used


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=6, help="first + (n-1) hits, at most 12")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_threads(a.threads)
    n = max(2, min(a.requests, len(QUESTIONS)))
    probe = LLM(kv_cache_memory="16MiB", num_threads=a.threads)
    system = system_prompt(probe.get_tokenizer(), a.system_tokens)
    del probe
    print(f"workload: ~{a.system_tokens}-token system prompt + a short question (chat "
          f"template), {n} requests one after another, max_tokens 1, {a.threads} threads")
    for budget in (a.max_num_batched_tokens, None):
        on, used = run(True, budget, system, n, a.threads)
        off, _ = run(False, budget, system, n, a.threads)
        label = f"{used}" + (" (default)" if budget is None else "")
        print(f"\nmax_num_batched_tokens = {label}")
        print(f"{'req':>4} {'prompt':>7} {'cached':>7} {'TTFT on (ms)':>13} "
              f"{'prefill on':>11} {'TTFT off (ms)':>14} {'prefill off':>12}")
        for i, (x, y) in enumerate(zip(on, off)):
            mx, my = x.metrics, y.metrics
            print(f"{i + 1:>4} {mx.num_prompt_tokens:>7} {mx.num_cached_tokens:>7} "
                  f"{mx.ttft_s * 1e3:>13.1f} {mx.prefill_s * 1e3:>11.1f} "
                  f"{my.ttft_s * 1e3:>14.1f} {my.prefill_s * 1e3:>12.1f}")
        assert on[0].metrics.num_cached_tokens == 0
        assert all(o.metrics.num_cached_tokens > 0 for o in on[1:])
        assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
        first = on[0].metrics.ttft_s
        hit = statistics.median(o.metrics.ttft_s for o in on[1:])
        disabled = statistics.median(o.metrics.ttft_s for o in off)
        print(f"TTFT first (miss) {first * 1e3:8.1f} ms | hit (median of {n - 1}) "
              f"{hit * 1e3:8.1f} ms | caching disabled (median of {n}) {disabled * 1e3:8.1f} ms")
        print(f"ratio first / hit     {first / hit:6.1f}x  (target >= 5x)")
        print(f"ratio disabled / hit  {disabled / hit:6.1f}x  (target >= 5x)")


if __name__ == "__main__":
    main()
