"""A worker process's entry: the WorkerSpec its supervisor built, validated, then the role.

    python -m kvfence.hub.worker_entry SPEC.json

`kvfence serve --disaggregated` writes one spec a worker (serve/specs.py) and starts each
worker with this entry, so a role's options are built once, in the supervisor, and never
turned back into argv. A spec that does not validate ends the worker with exit code 2 and
the reason, before it loads a model.
"""

from __future__ import annotations

import os
import sys

from kvfence.serve.specs import EXIT_BAD_SPEC, SpecError, WorkerSpec, spec_from_argv


def run_worker_process(spec: WorkerSpec) -> int:
    """Run one worker role to its end; this process then exits without finalisation."""
    from kvfence.serve.startup import collector_paused, set_torch_threads

    with collector_paused():  # start-up imports (serve/startup.py)
        set_torch_threads(spec.torch_threads)
        from kvfence.hub.workers import run_worker

    rc = run_worker(spec)  # sockets closed, shared memory unlinked, engines stopped
    # Skip interpreter finalisation: it took 7-20 s in workers holding torch and zmq state,
    # which made every supervised shutdown wait (nothing is left to flush but stdio).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main(argv: list[str]) -> int:
    try:
        spec = spec_from_argv(WorkerSpec, argv)
    except SpecError as e:
        print(f"kvfence worker: {e}", file=sys.stderr)
        return EXIT_BAD_SPEC
    return run_worker_process(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
