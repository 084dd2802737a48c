"""`python -m kvfence.sglang_stack.router_main ARGS`: SGLang's Rust router, started lean.

The same arguments and the same router as `python -m sglang_router.launch_router`
(sglang-router's own `RouterArgs` parse and check them, its Rust `Router` runs,
the process renames itself `sglang::router` as that launcher does), without
importing that launcher's Python fallback balancer (`mini_lb`, for debugging
only: FastAPI and aiohttp, about 0.7 s of CPU here).

`ARGS_ON_STDIN` as the only argument: load the router first, then read the
arguments as one JSON list on stdin. The stack (stack.py) starts the router
so, beside its workers: the router's URLs are the workers' ports, known only
once they announce, but loading the router need not wait for that.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

ARGS_ON_STDIN = "--args-on-stdin"


def parse(argv: list[str]) -> Any:
    """sglang-router's `RouterArgs` for `argv`, checked as its own launcher checks them."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="python -m kvfence.sglang_stack.router_main")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    if args.mini_lb:
        parser.error("--mini-lb is the Python debugging balancer: use sglang_router.launch_router")
    args._validate_router_args()  # what sglang_router.launch_router checks before it starts
    return args


def main(argv: list[str]) -> int:
    import setproctitle
    from sglang_router.router import Router  # the Rust router: loaded before any wait below

    setproctitle.setproctitle("sglang::router")
    if argv == [ARGS_ON_STDIN]:
        line = sys.stdin.readline()
        if not line:
            print("router_main: stdin closed before the router's arguments came", file=sys.stderr)
            return 1
        argv = [str(a) for a in json.loads(line)]
    Router.from_args(parse(argv)).start()  # blocks until the router shuts down
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
