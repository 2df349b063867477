"""Automatic prefix caching on the real default model: greedy outputs identical
with and without it, cached tokens exactly where the prefix is shared, and an
idle pool (every ref count 0, every block free) after each workload."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams

BLOCK = 16
# Exact equality with and without caching needs the fp32 model: with the GGUF's
# own int4 (W4A8), a prefix computed in another chunk can move an activation
# across a rounding edge and flip a near-tie. The same for queries rounded to
# bf16 (a bf16 cache, the CPU default with AVX512_BF16): the fp16 cache.
FP32 = "none"
KV = "fp16"
BYTES_PER_BLOCK = 2 * 30 * 3 * 64 * 2 * BLOCK  # K+V x layers x kv heads x head_dim x fp16

SYSTEM = (
    "You are Quill, the support assistant of Northwind Outfitters, a small company that "
    "sells hiking boots, tents, sleeping bags and rain jackets online and in two shops, one "
    "in Portland and one in Denver. Answer in one or two short sentences, politely and "
    "precisely. Orders over fifty dollars ship for free within the United States; smaller "
    "orders pay a flat shipping fee of six dollars. Standard delivery takes three to five "
    "working days and express delivery takes one to two working days for an extra fifteen "
    "dollars. Customers may return unworn items within sixty days for a full refund; worn "
    "boots can be exchanged once within thirty days if they do not fit. Gift cards never "
    "expire and can be used online and in the shops. The shops open from nine in the morning "
    "to seven in the evening on weekdays and from ten to five on Saturdays; they are closed "
    "on Sundays and public holidays. Tents come with a two-year warranty against "
    "manufacturing defects, sleeping bags with a one-year warranty. Never invent a policy "
    "that is not listed here; if you do not know the answer, ask the customer to write to "
    "help@northwind.example and say that a person will reply within one working day. "
    "Members of the Trail Club get ten percent off every order, early access to the spring "
    "sale and free express delivery twice a year; membership is free and customers can join "
    "at checkout. Repairs of tents and jackets cost a flat twenty dollars plus parts and take "
    "about two weeks."
)
QUESTIONS = [
    "How much is shipping for a $30 order?",
    "Can I return boots I wore once?",
    "When is the Denver shop open on Saturday?",
    "Do gift cards expire?",
    "How long does express delivery take?",
    "What warranty comes with a tent?",
    "Are you open on Sundays?",
    "Is shipping free for a $120 order?",
    "How long do I have to return a rain jacket?",
    "Can I use a gift card in the Portland shop?",
    "What does express delivery cost?",
    "Do sleeping bags have a warranty?",
    "Where are your shops?",
    "Who should I write to about a lost parcel?",
    "What time do the shops close on weekdays?",
    "Can I exchange boots that do not fit?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


def chat_ids(llm: LLM, system: str, question: str) -> list[int]:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_cached(prompts: list[list[int]]) -> list[int]:
    """Admitted in order with a pool big enough that nothing is evicted: each
    prompt hits the full blocks it shares with an earlier one, never its last
    token."""
    return [
        max((min(lcp(p, q), len(p) - 1) // BLOCK * BLOCK for q in prompts[:i]), default=0)
        for i, p in enumerate(prompts)
    ]


def assert_idle(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    assert all(b.ref_cnt == 0 for b in kv.blocks)
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert not llm.engine.has_unfinished_requests()


class Counters:
    """Deltas of the engine's prefix-cache counters (in tokens) over a block."""

    def __init__(self, llm: LLM) -> None:
        self.kv = llm.engine.kv_manager
        self.q0, self.h0 = self.kv.prefix_cache_queries, self.kv.prefix_cache_hits

    @property
    def queries(self) -> int:
        return self.kv.prefix_cache_queries - self.q0

    @property
    def hits(self) -> int:
        return self.kv.prefix_cache_hits - self.h0


@pytest.fixture(scope="module")
def llm_on():
    return LLM(kv_cache_memory="256MiB", quantization=FP32, kv_cache_dtype=KV)


@pytest.fixture(scope="module")
def llm_off():
    return LLM(kv_cache_memory="256MiB", enable_prefix_caching=False, quantization=FP32,
               kv_cache_dtype=KV)


@pytest.fixture(scope="module")
def system_prompts(llm_on):
    return [chat_ids(llm_on, SYSTEM, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def system_reference(llm_off, system_prompts):
    """The 16 questions with caching disabled: the reference outputs."""
    outs = llm_off.generate(system_prompts, GREEDY)
    assert all(o.metrics.num_cached_tokens == 0 for o in outs)
    assert llm_off.engine.kv_manager.prefix_cache_hits == 0
    assert_idle(llm_off)
    return token_ids(outs)


def test_shared_system_prompt_16_concurrent_questions(llm_on, system_prompts, system_reference):
    n_system = lcp(system_prompts[0], system_prompts[1])
    assert 280 <= n_system <= 340 and len(system_prompts) == 16
    c = Counters(llm_on)
    outs = llm_on.generate(system_prompts, GREEDY)  # all submitted at once
    assert token_ids(outs) == system_reference
    cached = [o.metrics.num_cached_tokens for o in outs]
    assert cached == expected_cached(system_prompts)
    assert cached[0] == 0 and min(cached[1:]) >= n_system // BLOCK * BLOCK
    # The engine counters (tokens) are the sums of the per-request figures.
    assert c.queries == sum(o.metrics.num_prompt_tokens for o in outs)
    assert c.hits == sum(cached)
    assert llm_on.engine.scheduler.num_preemptions == 0
    assert_idle(llm_on)


def test_chunked_prefill_with_caching(system_prompts, system_reference):
    # A 43-token budget: the system prompt is prefilled over 8 steps with chunk
    # edges inside blocks, and the second request is admitted in the step that
    # computes the last system blocks it hits (same forward: written, then read).
    budget = 43
    llm = LLM(kv_cache_memory="64MiB", max_num_batched_tokens=budget, quantization=FP32,
              kv_cache_dtype=KV)
    prompts = system_prompts[:6]
    n_system = lcp(prompts[0], prompts[1]) // BLOCK * BLOCK
    last_chunk = (len(prompts[0]) - 1) // budget * budget
    assert last_chunk < n_system and last_chunk % BLOCK
    sched = llm.engine.scheduler
    steps: list[dict[str, int]] = []  # per step: request id -> tokens computed before it
    schedule = sched.schedule

    def recording_schedule(now):
        out = schedule(now)
        steps.append({r.request_id: r.num_computed_tokens for r in out.requests})
        return out

    sched.schedule = recording_schedule
    c = Counters(llm)
    outs = llm.generate(prompts, GREEDY)
    assert token_ids(outs) == system_reference[:6]
    cached = [o.metrics.num_cached_tokens for o in outs]
    assert cached[0] == 0 and min(cached[1:]) >= n_system
    first, second = outs[0].request_id, outs[1].request_id
    assert any(s.get(first) == last_chunk and s.get(second) == cached[1] for s in steps)
    assert c.hits == sum(cached) and c.queries == sum(map(len, prompts))
    assert_idle(llm)


def test_multi_turn_conversation_replayed(llm_on, llm_off):
    tok = llm_on.get_tokenizer()
    eos = tok.eos_token_id
    turns = [
        "Hi! I bought a tent from you last spring.",
        "One of the poles cracked. Is that covered?",
        "Great. What should I do next?",
        "And how long will the replacement take to arrive?",
    ]
    system = "You are a helpful support assistant for an outdoor shop. Be brief."
    prompt = chat_ids(llm_on, system, turns[0])
    params = SamplingParams(temperature=0, max_tokens=16)
    history = 0  # tokens of the previous turn whose KV was computed (all but the last)
    cached_per_turn = []
    for i, _ in enumerate(turns):
        on = llm_on.generate([prompt], params)[0]
        off = llm_off.generate([prompt], params)[0]
        reply = on.outputs[0].token_ids
        assert reply == off.outputs[0].token_ids, f"turn {i}"
        cached = on.metrics.num_cached_tokens
        assert cached == history // BLOCK * BLOCK
        assert cached < on.metrics.num_prompt_tokens
        cached_per_turn.append(cached)
        history = len(prompt) + len(reply) - 1
        if i + 1 < len(turns):
            # The next prompt is this one + the reply + the next user message.
            ended = reply if reply[-1] == eos else reply + [eos]
            prompt = prompt + ended + tok.encode(
                f"\n<|im_start|>user\n{turns[i + 1]}<|im_end|>\n<|im_start|>assistant\n"
            )
    assert cached_per_turn[0] == 0
    assert all(b > a for a, b in zip(cached_per_turn, cached_per_turn[1:])), cached_per_turn
    assert_idle(llm_on)
    assert_idle(llm_off)


def test_eviction_when_the_working_set_exceeds_the_pool():
    # 24 blocks = 384 tokens; three distinct ~160-token prefixes (~10 blocks each)
    # cycled through it: the cache holds about two of them, so each prefix is
    # partly evicted before it comes back. Strict LRU over whole chains would
    # leave nothing of it; evicting the tail of a chain first keeps its head.
    nb = 24
    kw = dict(kv_cache_memory=nb * BYTES_PER_BLOCK, max_model_len=nb * BLOCK,
              quantization=FP32, kv_cache_dtype=KV)
    llm = LLM(**kw)
    ref = LLM(**kw, enable_prefix_caching=False)
    kv = llm.engine.kv_manager
    evictions = 0
    take = kv._take_free

    def counting_take(group: int):
        nonlocal evictions
        evictions += kv.free_blocks[next(iter(kv.free_blocks))].block_hash is not None
        return take(group)

    kv._take_free = counting_take
    systems = [
        f"{w} are our topic today. " + SYSTEM[: 640 + 60 * i]
        for i, w in enumerate(("Boots", "Tents", "Jackets"))
    ]
    order = [0, 1, 2, 0, 1, 2, 0, 1]
    prompts = [chat_ids(llm, systems[s], QUESTIONS[i]) for i, s in enumerate(order)]
    assert all(145 <= len(p) <= 190 for p in prompts)
    params = SamplingParams(temperature=0, max_tokens=4)
    batches = ([0], [1], [2], [3], [4], [5], [6, 7])  # one by one, then a pair

    def run(engine):
        outs = []
        for batch in batches:
            outs += engine.generate([prompts[i] for i in batch], params)
            assert_idle(engine)
        return outs

    c = Counters(llm)
    outs = run(llm)
    assert token_ids(outs) == token_ids(run(ref))
    cached = [o.metrics.num_cached_tokens for o in outs]
    full = expected_cached(prompts)  # what an unbounded pool would hit
    assert evictions > 0
    assert cached[:3] == [0, 0, 0] and min(full[3:]) >= 128
    assert all(c_ <= f for c_, f in zip(cached, full)), (cached, full)
    assert all(0 < c_ < f for c_, f in zip(cached[3:6], full[3:6])), (cached, full)
    assert c.hits == sum(cached)
    if llm.engine.scheduler.num_preemptions == 0:
        assert c.queries == sum(map(len, prompts))


def test_preempted_request_hits_its_own_blocks():
    # 10 blocks = 160 tokens for four requests that grow to ~55-60 tokens each:
    # running requests run out of blocks and the newest is preempted; its full
    # blocks stay cached (the partial tail is evicted first) and it hits them
    # when re-admitted.
    nb = 10
    kw = dict(kv_cache_memory=nb * BYTES_PER_BLOCK, max_model_len=nb * BLOCK,
              quantization=FP32, kv_cache_dtype=KV)
    llm = LLM(**kw)
    ref = LLM(**kw, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    texts = [
        "Once upon a time, in a small village by the sea, there lived an old fisherman who "
        "every morning",
        "The three laws of thermodynamics are easy to state and hard to understand. The first",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "A short history of the bicycle: the first two-wheeled, steerable machine",
    ]
    prompts = [tok.encode(t) for t in texts]
    assert all(lcp(a, b) < BLOCK for a in prompts for b in prompts if a is not b)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    sched = llm.engine.scheduler
    readmitted: list[tuple[str, int]] = []  # (request, tokens hit) at each re-admission
    schedule = sched.schedule

    def recording_schedule(now):
        waiting = {id(r) for r in sched.waiting}
        out = schedule(now)
        for r in out.requests:
            if id(r) in waiting and r.num_preemptions:
                readmitted.append((r.request_id, r.num_computed_tokens))
        return out

    sched.schedule = recording_schedule
    c = Counters(llm)
    outs = llm.generate(prompts, params)
    assert sched.num_preemptions > 0 and readmitted
    assert sum(o.metrics.num_cached_tokens for o in outs) == 0  # distinct prompts
    # Every hit came from a preempted request finding its own blocks again.
    assert c.hits == sum(n for _, n in readmitted) >= BLOCK
    assert c.queries > sum(map(len, prompts))  # re-admissions query prompt + output
    assert token_ids(outs) == token_ids(ref.generate(prompts, params))
    assert ref.engine.scheduler.num_preemptions > 0
    assert_idle(llm)
    assert_idle(ref)


@pytest.mark.parametrize("remainder", [1, 0])
def test_last_prompt_token_is_always_computed(llm_on, remainder):
    # A prompt resubmitted unchanged is fully cached, yet its last token runs
    # through the model: a length of 16k+1 hits 16k tokens, one of 16k hits
    # 16(k-1) (the block holding the last token is recomputed).
    ids = chat_ids(llm_on, f"Case {remainder}. " + SYSTEM[::-1][:300], "Say something.")
    ids = ids[: len(ids) // BLOCK * BLOCK - 2 * BLOCK + remainder]
    first = llm_on.generate([ids], GREEDY)[0]
    again = llm_on.generate([ids], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    n = len(ids)
    assert again.metrics.num_cached_tokens == (n - 1) // BLOCK * BLOCK
    assert again.metrics.num_cached_tokens == (n - 1 if remainder else n - BLOCK)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_idle(llm_on)
