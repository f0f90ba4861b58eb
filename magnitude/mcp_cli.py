"""``magnitude mcp serve``: the command; the server itself (and the MCP SDK it imports) loads only when it runs."""

from __future__ import annotations


def cmd_serve(args, config) -> int:
    from magnitude.mcp_server import serve
    return serve(config, args.http, args.host)


def register(sub) -> None:
    p = sub.add_parser("mcp", help="Magnitude as an MCP server (memory, calculator, run_agent)")
    mcp_sub = p.add_subparsers(dest="mcp_command", required=True)
    s = mcp_sub.add_parser("serve", help="serve over stdio (default) or streamable HTTP (--http PORT)")
    s.add_argument("--http", type=int, metavar="PORT", help="streamable HTTP at http://HOST:PORT/mcp instead of stdio")
    s.add_argument("--host", default="127.0.0.1", help="HTTP address; anything but loopback needs API keys "
                                                       "(scripts/ops/keys api-key NAME)")
    s.set_defaults(fn=cmd_serve)
