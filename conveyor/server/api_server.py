"""OpenAI-compatible HTTP server (placeholder until issue 3 lands)."""

from __future__ import annotations

import argparse


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)


def run_server(args: argparse.Namespace) -> int:
    raise ValueError("the HTTP server is not built yet")
