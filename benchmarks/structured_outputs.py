"""Aggregate tok/s with half the streams JSON-schema constrained vs none, and the
per-row cost of the grammar masks.

Workload: 32 concurrent streams through one engine, each --output-len tokens at
temperature 1.0 (seeded). The constrained half asks for a JSON object holding an
array of at least 100 records, so no grammar can finish within the token limit
and both runs decode exactly the same number of tokens per stream: the ratio is
the cost of the masks alone (fill, unpack, apply, advance). The two runs are
interleaved over --rounds and the best round of each is kept (shared machines).
The mask fill is also timed alone, on matchers walking valid documents.
Target: ratio >= 0.9.

``--strict-auto``: instead, every stream is a chat with two strict tools under
``tool_choice: "auto"`` (free text, each call constrained from its <tool_call>
on: the structural tag the server builds), against the same prompts with no
constraint. Target: ratio >= 0.95.

    .venv/bin/python benchmarks/structured_outputs.py [--streams 32] [--output-len 128]
        [--rounds 2] [--quantization int4] [--model llama-1b-q4_0.gguf] [--strict-auto]
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

from common import set_threads

from tandem import LLM, SamplingParams
from tandem.entrypoints.server.protocol import ChatTool
from tandem.entrypoints.server.structured import plan_tools, template_messages
from tandem.sampling_params import StructuredOutputsParams

RECORD = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "email": {"type": "string"}, "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "active"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {
    "people": {"type": "array", "items": RECORD, "minItems": 100}},
    "required": ["people"], "additionalProperties": False}


def strict_auto(llm: LLM) -> tuple[list[int], StructuredOutputsParams]:
    """A chat that offers two strict tools (the server's Hermes prompt), and the
    constraint the server puts on it under tool_choice auto."""
    tools = [ChatTool.model_validate({"type": "function", "function": {
        "name": name, "strict": True, "parameters": {"type": "object", "properties": {
            key: {"type": "string"}}, "required": [key], "additionalProperties": False}}})
        for name, key in (("get_weather", "city"), ("get_time", "zone"))]
    plan = plan_tools(tools, "auto", True, None)
    ask = [{"role": "user", "content": "Tell me about the weather in Oslo and in Rome."}]
    messages, _ = template_messages(ask, plan, None)
    return llm.get_tokenizer().apply_chat_template(messages), plan.constraint().params


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="default: the model's own")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M; a "
                    "bigger model's longer step makes the same mask cost a smaller share")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--strict-auto", action="store_true",
                    help="strict tools under tool_choice auto on every stream, vs none")
    a = ap.parse_args()
    set_threads(a.threads)
    kw = {} if a.quantization is None else {"quantization": a.quantization}
    if a.model is not None:
        kw["model"] = a.model
    llm = LLM(kv_cache_memory="1GiB", num_threads=a.threads, max_num_seqs=a.streams, **kw)
    engine = llm.engine
    grammar = engine.structured_output
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content":
        "List 100 people as JSON: name, age, email and whether they are active."}])
    spec = StructuredOutputsParams(json=SCHEMA)
    if a.strict_auto:
        prompt, spec = strict_auto(llm)

    def params(i: int, constrained: bool) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=a.output_len, ignore_eos=True,
                              structured_outputs=spec if constrained else None)

    # Time the mask fills: the per-row cost.
    masks = grammar.masks
    filled = {"rows": 0, "s": 0.0}

    def timed_masks(reqs):
        t = time.perf_counter()
        out = masks(reqs)
        filled["s"] += time.perf_counter() - t
        filled["rows"] += 0 if out is None else len(out[0])
        return out

    grammar.masks = timed_masks

    def run(half: bool) -> tuple[float, float | None]:
        ps = [params(i, half and (a.strict_auto or i % 2 == 0)) for i in range(a.streams)]
        filled.update(rows=0, s=0.0)
        t = time.perf_counter()
        outs = llm.generate([prompt] * a.streams, ps)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n == a.streams * a.output_len, n  # no stream ended early
        per_row = filled["s"] / filled["rows"] * 1e6 if filled["rows"] else None
        return n / dt, per_row

    run(True)  # warm-up: compiles the grammar, first touches
    best: dict[bool, tuple[float, float | None]] = {}
    for _ in range(a.rounds):
        for half in (False, True):
            rate, per_row = run(half)
            if half not in best or rate > best[half][0]:
                best[half] = (rate, per_row)
    if a.strict_auto:
        base, (rate, per_row) = best[False][0], best[True]
        print(f"workload: {a.streams} streams x {a.output_len} tokens, T=1.0, a chat with two "
              f"strict tools, {a.threads} threads, best of {a.rounds} rounds")
        print(f"no constraint           {base:7.1f} tok/s")
        print(f"strict tools under auto {rate:7.1f} tok/s = {rate / base:.3f}x (target >= 0.95), "
              f"mask fill {per_row:.1f} us per row per step")
        return
    # The same fills alone (no forward beside them): 16 matchers walking valid documents.
    tok = llm.get_tokenizer()
    docs = [tok.encode(json.dumps({"people": [
        {"name": f"Person {i}-{j}", "age": 20 + i + j, "email": f"p{i}.{j}@example.org",
         "active": (i + j) % 2 == 0} for j in range(3)]})[:-2], add_special_tokens=False)
        for i in range(a.streams // 2)]  # [:-2]: open, as 100 records are due
    reqs = [SimpleNamespace(structured_output_request=grammar.new_request(spec)) for _ in docs]
    filled.update(rows=0, s=0.0)
    for pos in range(min(len(d) for d in docs)):
        grammar.masks(reqs)
        for r, d in zip(reqs, docs):
            r.structured_output_request.accept(d[pos])
    alone = filled["s"] / filled["rows"] * 1e6
    base = best[False][0]
    rate, per_row = best[True]
    print(f"workload: {a.streams} streams x {a.output_len} tokens, T=1.0, half constrained by a "
          f"JSON schema (llguidance), {a.threads} threads, best of {a.rounds} rounds")
    print(f"unconstrained     {base:7.1f} tok/s")
    print(f"half constrained  {rate:7.1f} tok/s = {rate / base:.3f}x (target >= 0.9)")
    print(f"mask fill         {per_row:.1f} us per constrained row per step in the run, "
          f"{alone:.1f} us walking valid documents ({len(docs)} rows)")


if __name__ == "__main__":
    main()
