"""``tandem bench``: measure any OpenAI- or Ollama-compatible server before tuning it.

* ``serve``: a load generator in the spirit of ``vllm bench serve`` (same flag
  names, metric definitions and JSON keys), plus server-side numbers scraped
  from ``/metrics`` when the target exposes vLLM's names;
* ``phases``: the prefill-vs-decode experiment (short vs long prompt, same
  output length);
* ``compare``: saved results side by side, with ratios.
"""
