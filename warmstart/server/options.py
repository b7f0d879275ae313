"""The server's own options (not the engine's): access control, CORS, output parsers. Frozen, from the CLI."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from warmstart.errors import UserError
from warmstart.server import reasoning, tools

OPEN_ROUTES = ("/health", "/ready", "/metrics")


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None                       # required as "Authorization: Bearer <key>" when set
    open_routes: tuple[str, ...] = OPEN_ROUTES       # answered without the key
    allowed_origins: tuple[str, ...] = ()            # CORS; none by default
    tool_call_parser: str = "auto"                   # auto | hermes | llama3_json
    reasoning_parser: str = "auto"                   # auto | none | qwen3

    def __post_init__(self) -> None:
        if self.tool_call_parser not in ("auto", *tools.PARSERS):
            raise UserError(f"--tool-call-parser must be auto or one of {', '.join(tools.PARSERS)}.")
        if self.reasoning_parser not in ("auto", "none", *reasoning.PARSERS):
            raise UserError(f"--reasoning-parser must be auto, none or one of {', '.join(reasoning.PARSERS)}.")
        if self.api_key is not None and not self.api_key:
            raise UserError("--api-key must not be empty.")

    @classmethod
    def from_args(cls, args) -> "ServerOptions":
        key = args.api_key if args.api_key is not None else os.environ.get("WARMSTART_API_KEY") or None
        open_routes = OPEN_ROUTES if args.open_routes is None else tuple(r for r in args.open_routes.split(",") if r)
        return cls(key, open_routes, tuple(args.allowed_origins or ()), args.tool_call_parser,
                   args.reasoning_parser)

    def parsers(self, chat_template: str | None, model_dir: Path) -> dict:
        """The tool and reasoning parsers for this model: the flags, else what its family and template say."""
        try:
            model_type = json.loads((model_dir / "config.json").read_text()).get("model_type", "")
        except (OSError, ValueError):
            model_type = ""
        tool = self.tool_call_parser
        if tool == "auto":
            tool = tools.default_parser(chat_template, model_type)
        reason = self.reasoning_parser
        if reason == "auto":
            reason = reasoning.default_parser(chat_template)
        return {"tool_parser": tool, "reasoning_parser": None if reason == "none" else reason}


def add_cli_args(g) -> None:
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but the open ones (default: "
                        "$WARMSTART_API_KEY, else no key)")
    g.add_argument("--open-routes", default=None, metavar="PATHS",
                   help=f"comma-separated routes answered without the key (default {','.join(OPEN_ROUTES)})")
    g.add_argument("--allowed-origins", nargs="*", default=None, metavar="ORIGIN",
                   help="CORS: browser origins allowed to call the API, e.g. http://localhost:3000 (default none)")
    g.add_argument("--tool-call-parser", default="auto", choices=["auto", *tools.PARSERS],
                   help="how tool calls are read from the output (default: by model family and chat template)")
    g.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *reasoning.PARSERS],
                   help="split <think> reasoning into reasoning_content (default: qwen3 for Qwen3 templates)")
