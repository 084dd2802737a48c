"""`python -m kvfence.sglang_stack.edge_main --args-on-stdin`: the stack's public address.

Started beside the workers and the router (its imports overlap their model loads), it
reads one JSON object on stdin once the router is up (`EdgeArgs`: where the router and
workers are, the tenants file, the router secret file, the body bounds), binds the public
host and port, prints `ANNOUNCE` + `{"url": ...}` and serves `edge.Edge` until SIGTERM.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ANNOUNCE = "KVFENCE_SGLANG_EDGE "
ARGS_ON_STDIN = "--args-on-stdin"


@dataclass(frozen=True, slots=True)
class EdgeArgs:
    host: str
    port: int  # 0 = any free port (announced)
    router: str
    workers: tuple[str, ...]
    side: str
    model: str
    tenants_file: str
    secret_file: str
    body_limit: int
    pool_tokens: int  # every prefill worker's pool, in tokens
    longest: int  # the longest request a worker admits
    log_level: str = "warning"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> EdgeArgs:
        obj = json.loads(line)
        return cls(**{**obj, "workers": tuple(obj["workers"])})


def main(argv: list[str]) -> int:
    from kvfence.serve.tenants import TenantRegistry
    from kvfence.serve.thread import bind, serve_forever, url_of
    from kvfence.sglang_stack.edge import Edge, EdgeSpec

    if argv != [ARGS_ON_STDIN]:
        print(f"usage: python -m kvfence.sglang_stack.edge_main {ARGS_ON_STDIN}", file=sys.stderr)
        return 2
    line = sys.stdin.readline()
    if not line:
        print("edge_main: stdin closed before the edge's arguments came", file=sys.stderr)
        return 1
    args = EdgeArgs.from_json(line)
    spec = EdgeSpec(
        router=args.router,
        workers=args.workers,
        side=args.side,
        secret=Path(args.secret_file).read_text().strip(),
        model=args.model,
        body_limit=args.body_limit,
        pool_tokens=args.pool_tokens,
        longest=args.longest,
    )
    app = Edge(spec, TenantRegistry.from_file(args.tenants_file))
    sock = bind(args.host, args.port)
    print(ANNOUNCE + json.dumps({"url": url_of(sock)}), flush=True)
    serve_forever(app, sock, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
