"""Continuous batching seen from outside: later streams start while the first one runs."""

from __future__ import annotations

import asyncio
import json
import time

import httpx


async def _stream(client: httpx.AsyncClient, url: str, headers: dict, body: dict,
                  first: asyncio.Event) -> dict:
    t0 = time.monotonic()
    t_first = None
    n = 0
    async with client.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                n += 1
                if t_first is None:
                    t_first = time.monotonic()
                    first.set()
    return {"start": t0, "first": t_first, "end": time.monotonic(), "tokens": n}


def test_four_streams_overlap(real_server):
    url = f"{real_server.url}/v1/completions"

    def body(max_tokens: int) -> dict:
        return {"model": "smollm2", "prompt": "Tell me a story about a dragon.",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            events = [asyncio.Event() for _ in range(4)]
            first = asyncio.create_task(_stream(client, url, real_server.headers, body(40),
                                                events[0]))
            await asyncio.wait_for(events[0].wait(), 60)
            later = [asyncio.create_task(_stream(client, url, real_server.headers, body(16), e))
                     for e in events[1:]]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events[1:])), 60)
            metrics = await client.get(f"{real_server.url}/metrics")
            first_done_when_scraped = first.done()
            return await first, await asyncio.gather(*later), metrics.text, \
                first_done_when_scraped

    a, others, metrics, a_done = asyncio.run(main())
    assert a["tokens"] == 40 and all(o["tokens"] == 16 for o in others)
    # The later requests got their first token while the first was still streaming...
    assert max(o["first"] for o in others) < a["end"]
    # ...and /metrics saw them in one batch at that moment.
    running = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("vllm:num_requests_running{"))
    assert not a_done and running > 1
    total = a["tokens"] + sum(o["tokens"] for o in others)
    span = max(o["end"] for o in [a, *others]) - a["start"]
    ttfts = [o["first"] - o["start"] for o in others]
    print(f"\n4 streams: {total} tokens in {span:.2f} s = {total / span:.1f} tok/s aggregate; "
          f"first stream alone TTFT {a['first'] - a['start']:.2f} s; joiners' TTFT "
          f"{min(ttfts):.2f}-{max(ttfts):.2f} s; running={running:.0f} when scraped")
