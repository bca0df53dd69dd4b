"""CLI commands that fgrpo-rewards adds through the ``fgrpo_register_commands`` hook.

Kept light: ``fgrpo`` imports this module for every command; the server is imported when run.
"""

from __future__ import annotations

from typing import Any

from fgrpo.core.cli import finite_number, integer_at_least, port_number
from fgrpo.core.hookspecs import hookimpl


def _serve(args: Any) -> int:
    from fgrpo.rewards.serving import serve

    return serve(args)


@hookimpl
def fgrpo_register_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve-reward",
        help="serve a registered reward over HTTP for `reward: {name: remote, url: ...}`",
        description="Build the reward NAME once and score batches POSTed by remote rewards. Binds "
        "127.0.0.1 unless --host says otherwise; any other address needs a shared token in the "
        "environment variable named by --token-env.",
    )
    p.add_argument("name", help="the reward to serve (fgrpo plugins lists them)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe key of the reward, e.g. --set path=/models/PickScore_v1 (repeatable)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind, IPv4 or IPv6 (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=port_number, default=8765, help="port (0 = any free one; the chosen one is printed)")
    p.add_argument("--token-env", default="FGRPO_REWARD_TOKEN", help="environment variable holding the shared token")
    p.add_argument(
        "--max-request-mb",
        type=finite_number(0, strict=True),
        default=512.0,
        help="larger requests are refused unread",
    )
    p.add_argument(
        "--max-inflight-mb",
        type=finite_number(0, strict=True),
        default=1024.0,
        help="requests being read, decoded or scored share this much (their wire and decoded bytes); past it a "
        "request is told to retry (503)",
    )
    p.add_argument(
        "--max-decoded-mb",
        type=finite_number(0, strict=True),
        default=1024.0,
        help="a request whose tensors take more as float32 (what the reward is given) is refused (413) before "
        "the rest of its body is read; decoded bytes count in --max-inflight-mb beside the wire bytes",
    )
    p.add_argument(
        "--max-connections",
        type=integer_at_least(1),
        default=512,
        help="connections open at once; more are told to retry (503)",
    )
    p.add_argument(
        "--read-timeout-s",
        type=finite_number(0, strict=True),
        default=30.0,
        help="seconds a request (head and body) may take to arrive, and its answer to be taken",
    )
    p.add_argument(
        "--batch-size",
        type=integer_at_least(1),
        default=None,
        help="samples scored together, from all waiting requests (default: the reward's batch_size, else 64)",
    )
    p.set_defaults(handler=_serve)
