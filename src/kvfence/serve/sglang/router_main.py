"""`python -m kvfence.serve.sglang.router_main ARGS`: SGLang's Rust router, started lean.

The same arguments and the same router as `python -m sglang_router.launch_router`
(sglang-router's own `RouterArgs` parse and check them, its Rust `Router` runs,
the process renames itself `sglang::router` as that launcher does), without
importing that launcher's Python fallback balancer (`mini_lb`, for debugging
only: FastAPI and aiohttp). The stack starts the router after its workers
announce, so those imports (about 0.7 s of CPU here) were start-up time of the
whole stack, paid while nothing else could run.
"""

from __future__ import annotations

import argparse
import sys

import setproctitle
from sglang_router.router import Router
from sglang_router.router_args import RouterArgs


def parse(argv: list[str]) -> RouterArgs:
    parser = argparse.ArgumentParser(prog="python -m kvfence.serve.sglang.router_main")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    if args.mini_lb:
        parser.error("--mini-lb is the Python debugging balancer: use sglang_router.launch_router")
    args._validate_router_args()  # what sglang_router.launch_router checks before it starts
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    setproctitle.setproctitle("sglang::router")
    Router.from_args(args).start()  # blocks until the router shuts down


if __name__ == "__main__":
    main(sys.argv[1:])
