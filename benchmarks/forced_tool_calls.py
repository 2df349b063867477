"""How often a forced, parallel tool call ends on its own, with and without the
grammar's ban on repeated calls (``uniqueItems``, enforced at mask time).

Six prompts, each with ``tool_choice: "required"`` and parallel calls allowed,
sampled at temperature 1.0 with 100 seeds and ``max_tokens: 100`` on the
default model, through the server's own tool plan and chat template. For each:
the share of responses that repeat a call and the share that end on their own
(``stop``) rather than at max_tokens, for the same requests without the ban
(the baseline, in the same run) and with it.

    python benchmarks/forced_tool_calls.py [--seeds 100] [--max-tokens 100]
"""

from __future__ import annotations

import argparse
import json

from common import set_threads

from tandem import LLM, SamplingParams
from tandem.entrypoints.server.protocol import ChatTool
from tandem.entrypoints.server.structured import plan_tools, template_messages
from tandem.sampling_params import StructuredOutputsParams


def _tool(name: str, **props: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}


S = {"type": "string"}
WEATHER = _tool("get_weather", city=S, unit={"type": "string", "enum": ["c", "f"]})
PROMPTS = [
    ("What's the weather in Oslo?", [WEATHER]),
    ("What's the weather in Paris and in Tokyo?", [WEATHER]),
    ("Convert 100 USD to EUR.", [_tool("convert_currency", amount={"type": "number"},
                                       source=S, target=S)]),
    ("Search the web for the latest Python release.", [_tool("web_search", query=S)]),
    ("Email bob@example.com to say the build is green.",
     [_tool("send_email", to=S, subject=S, body=S)]),
    ("What time is it in London, and is it raining there?",
     [WEATHER, _tool("get_time", timezone=S)]),
]


def calls_of(text: str) -> list[str] | None:
    try:
        calls = json.loads(text)
    except ValueError:
        return None  # cut at max_tokens
    return [json.dumps(c, sort_keys=True) for c in calls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=100)
    args = ap.parse_args()
    set_threads()
    llm = LLM()
    tok = llm.get_tokenizer()
    print(f"{'prompt':<52} {'repeats':>15} {'ends on its own':>17}")
    print(f"{'':<52} {'without  with':>15} {'without  with':>17}")
    for prompt, tools in PROMPTS:
        plan = plan_tools([ChatTool.model_validate(t) for t in tools], "required", True, None)
        schema = plan.constraint().params.json
        messages, _ = template_messages([{"role": "user", "content": prompt}], plan, None)
        text = tok.render_chat(messages)
        row = []
        for unique in (False, True):
            spec = {k: v for k, v in schema.items() if unique or k != "uniqueItems"}
            params = [SamplingParams(temperature=1.0, seed=s, max_tokens=args.max_tokens,
                                     structured_outputs=StructuredOutputsParams(json=spec))
                      for s in range(args.seeds)]
            outs = [o.outputs[0] for o in llm.generate([text] * args.seeds, params)]
            calls = [calls_of(o.text) for o in outs]
            repeats = sum(c is not None and len(set(c)) < len(c) for c in calls)
            ends = sum(o.finish_reason == "stop" for o in outs)
            row.append((repeats / args.seeds, ends / args.seeds))
        print(f"{prompt[:52]:<52} {row[0][0]:>7.0%} {row[1][0]:>6.0%} "
              f"{row[0][1]:>9.0%} {row[1][1]:>6.0%}")


if __name__ == "__main__":
    main()
