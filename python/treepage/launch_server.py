"""`python -m treepage.launch_server [flags]`: flags -> ServerArgs -> Engine -> HTTP server.

Start-up mistakes (a bad flag, a model that cannot be loaded) end with one line on stderr and exit code 2,
never a traceback: the message is what the user needs, the stack is not.
"""

from __future__ import annotations

import logging
import os
import sys

# Before torch starts OpenMP: spinning workers stall every forward when the scheduler and forward threads
# (or other processes) share few cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from treepage.server_args import ArgumentError, ServerArgs, parse_args  # noqa: E402

EXIT_BAD_ARGS = 2
_PROG = "treepage.launch_server"


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_ARGS


def _loading_context(args: ServerArgs) -> str:
    parts = [f"--model-path {args.model_path or '<embedded default model>'}"]
    if args.speculative_draft_model_path:
        parts.append(f"--speculative-draft-model-path {args.speculative_draft_model_path}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # argparse reports unknown flags and bad choices itself (exit code 2)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Imported late so a flag typo is reported before torch is loaded.
    from treepage.entrypoints.engine import Engine
    from treepage.entrypoints.http_server import serve

    try:
        engine = Engine(args)
    except ArgumentError as e:
        return _fail(str(e))
    except (ValueError, OSError) as e:
        return _fail(f"{e} (while loading {_loading_context(args)})")
    if not args.skip_server_warmup:
        engine.generate(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    serve(args, engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
