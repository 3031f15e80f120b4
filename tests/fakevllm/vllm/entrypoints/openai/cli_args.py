"""STAND-IN of ``vllm.entrypoints.openai.cli_args``: the ``vllm serve`` flags the worker uses."""

from __future__ import annotations

import argparse

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser


def make_arg_parser(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    """Frontend flags (host, port, API keys, chat template, tools) and the engine's."""
    parser.add_argument("model_tag", nargs="?", default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", nargs="+", default=None)
    parser.add_argument("--chat-template", default=None)
    parser.add_argument("--enable-auto-tool-choice", action="store_true", default=False)
    parser.add_argument("--tool-call-parser", default=None)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", default=False)
    parser.add_argument("--disable-fastapi-docs", action="store_true", default=False)
    parser.add_argument("--root-path", default=None)
    parser.add_argument("--uvicorn-log-level", default="info")
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise TypeError("Error: --enable-auto-tool-choice requires --tool-call-parser")
