"""tandem's command line: serve | generate | chat | plan | doctor | bench | top."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tandem.config import EngineConfig, cli_fields, flag_names
from tandem.distributed.config import add_scale_out_args, spec_from_args
from tandem.entrypoints.server.args import add_server_args

# The tools (tandem[tools] extra: httpx, matplotlib) register their own sub-commands.
# Without the extra each still appears, and says what to install instead of failing
# with an ImportError deep inside a run.
TOOLS = {
    "plan": ("tandem.tools.plan.cli", "capacity plan: memory, KV cache, concurrency, settings"),
    "doctor": ("tandem.tools.doctor.cli", "diagnose a running server: which phase is slow"),
    "bench": ("tandem.tools.bench.cli", "benchmark a running server: load, phases, compare"),
    "top": ("tandem.tools.top", "watch a running server's dashboard in the terminal"),
}

ENGINE_HELP = """\
engine flags (vLLM's names):
  The KV cache is a pool of fixed-size blocks sized once at startup; free blocks
  become concurrency. Each step has a token budget shared by running decodes
  (1 token each) and prefill chunks: a small budget keeps streams smooth while
  someone else's long prompt is prefilled (ITL), a large one gets first tokens
  out sooner (TTFT).
"""


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, its help, choices and default taken from the
    field (tandem/config.py is the one place an engine default is written)."""
    g = p.add_argument_group("engine")
    for f in cli_fields(EngineConfig):
        meta, kwargs = f.metadata, {"dest": f.name, "default": f.default}
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta["type"] or (str if f.default is None else type(f.default))
            if meta["choices"] is not None:
                kwargs["choices"] = meta["choices"]
        default = "" if f.default is None else f" (default {f.default})"
        g.add_argument(*flag_names(f), help=meta["help"] + default, **kwargs)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(a, f.name) for f in cli_fields(EngineConfig)})


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed-sampling", dest="sampling_seed", type=int, default=None,
                   help="per-request sampling seed")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(a: argparse.Namespace):
    from tandem.sampling_params import SamplingParams

    if a.max_tokens < 1:  # the library's 0 (the prompt alone) prints nothing here
        raise ValueError(f"max_tokens must be at least 1, got {a.max_tokens}")
    return SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
        min_p=a.min_p, seed=a.sampling_seed, repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
        stop=a.stop, min_tokens=a.min_tokens, ignore_eos=a.ignore_eos,
    )


def _stream(engine, prompt_ids: list[int], params) -> None:
    """Run one request, printing text as it streams, then its phase split."""
    req = engine.add_request(prompt_ids, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == req.request_id:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
                if out.finished:
                    final = out
    sys.stdout.write("\n")
    m = final.metrics
    print(
        f"[{final.finish_reason}] prompt {m.num_prompt_tokens} tokens "
        f"({m.num_cached_tokens} cached): queue {m.queued_s * 1e3:.0f} ms, "
        f"prefill {m.prefill_s * 1e3:.0f} ms ({m.prefill_tokens_per_s:.0f} tok/s) | "
        f"output {m.num_output_tokens} tokens: decode {m.decode_s:.2f} s "
        f"({m.decode_tokens_per_s:.1f} tok/s)",
        file=sys.stderr,
    )


def cmd_generate(a: argparse.Namespace, chat: bool) -> int:
    from tandem.engine.llm_engine import LLMEngine

    params = sampling_params_from_args(a)  # bad input fails before the model loads
    if not all(a.prompt):
        raise ValueError("the prompt is empty")
    engine = LLMEngine(engine_config_from_args(a))
    if engine.tokenizer is None:
        raise ValueError("this model has no tokenizer")
    for prompt in a.prompt:
        if chat:
            messages = [{"role": "user", "content": prompt}]
            if a.system:
                messages.insert(0, {"role": "system", "content": a.system})
            ids = engine.tokenizer.apply_chat_template(messages)
        else:
            ids = engine.tokenizer.encode(prompt)
        _stream(engine, ids, params)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "serve", help="the HTTP server: OpenAI- and Ollama-compatible APIs, /metrics",
        description=ENGINE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    add_engine_args(p)
    add_scale_out_args(p)
    for name, helptext in (
        ("generate", "complete a raw prompt, streaming the text"),
        ("chat", "one-shot chat: the prompt as a user message, with the chat template"),
    ):
        p = sub.add_parser(name, help=helptext, description=ENGINE_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("prompt", nargs="+", help="prompt text (several run one after another)")
        if name == "chat":
            p.add_argument("--system", default=None, help="system message")
        add_engine_args(p)
        add_sampling_args(p)
    for name, (module, helptext) in TOOLS.items():
        _register_tool(sub, name, module, helptext)
    return parser


def _register_tool(sub, name: str, module: str, helptext: str) -> None:
    try:
        importlib.import_module(module).register(sub)
    except ModuleNotFoundError as e:
        missing = e.name

        def unavailable(_: argparse.Namespace) -> int:
            print(f"tandem {name} needs the tools extra (missing module {missing!r}): "
                  "pip install 'tandem[tools]'", file=sys.stderr)
            return 2

        p = sub.add_parser(name, help=f"{helptext} [needs tandem[tools]]", add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(func=unavailable)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        if a.command == "serve":
            from tandem.engine.async_engine import AsyncEngine
            from tandem.entrypoints.server.run import serve

            config = engine_config_from_args(a)
            config.skip_tokenizer_init = a.skip_tokenizer_init
            spec = spec_from_args(a)
            if spec is not None:  # Ray is imported only here
                from tandem.distributed.client import RayEngineClient

                return serve(a, lambda: RayEngineClient(config, spec))
            return serve(a, lambda: AsyncEngine(config))
        if a.command == "generate":
            return cmd_generate(a, chat=False)
        if a.command == "chat":
            return cmd_generate(a, chat=True)
        return a.func(a)
    except ValueError as e:
        print(f"tandem {a.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the user named or the cache: unreadable, unwritable, full
        print(f"tandem {a.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
