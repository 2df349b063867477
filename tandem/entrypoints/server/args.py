"""``tandem serve``'s own flags (the engine's are in entrypoints/cli.py); no torch import."""

from __future__ import annotations

import argparse
import os

from tandem.entrypoints.server.reasoning import MODES as REASONING_MODES


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (0.0.0.0 for all; default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port for both APIs (default 8000)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model file's name)")
    g.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on the API routes "
                        "(default: $TANDEM_API_KEY, else none)")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins (CORS) that may call the APIs besides pages on "
                        "this machine (http(s)://localhost or 127.0.0.1 at any port, and "
                        "app://, file://, tauri://, vscode-webview://, vscode-file://, as "
                        "Ollama allows), e.g. https://chat.example.com, or '*' for any")
    g.add_argument("--max-queue", type=int, default=None,
                   help="requests that may wait beyond the running batch before new ones get "
                        "503 + Retry-After at once (default: --max-num-seqs, about one "
                        "reply's time of waiting)")
    g.add_argument("--stats-interval", type=float, default=10.0,
                   help="seconds between stats log lines (default 10)")
    g.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="time-to-first-token target: a line on /dashboard's latency chart, "
                        "and the doctor's verdict there judges TTFT by it (unset: no line, "
                        "and the verdict judges by 1000)")
    g.add_argument("--slo-itl-ms", type=float, default=None,
                   help="inter-token latency target, as --slo-ttft-ms (unset: no line, and "
                        "the verdict judges by 100: 10 tok/s, reading speed)")
    g.add_argument("--dashboard-max-viewers", type=int, default=8,
                   help="/dashboard feeds open at once; more get 429 (default 8; 0: off)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: token-id prompts only (e.g. --load-format dummy "
                        "with a bare config.json)")
    g.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="do not log one line per HTTP request")
    g.add_argument("--reasoning-parser", default="auto",
                   choices=REASONING_MODES,
                   help="move <think> ... </think> out of the answer into the APIs' reasoning "
                        "fields (reasoning_content, Ollama's thinking): auto = when the chat "
                        "template writes think blocks (Qwen3, QwQ, DeepSeek-R1); none = "
                        "leave it in the text; qwen3 / deepseek_r1 (vLLM's names) = always "
                        "(default auto)")
    g.add_argument("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
                   help="sampling defaults for fields a request leaves out: auto = the "
                        "model's generation_config.json or GGUF sampling metadata, else "
                        "temperature 0.8, top_k 40, top_p 0.9; vllm = none (temperature 1); "
                        "DIR = the generation_config.json in DIR (default auto)")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults over those, e.g. '{\"temperature\": 0.5}' (keys: "
                        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)")
