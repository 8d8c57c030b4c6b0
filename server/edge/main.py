"""`translate-server`: parse the configuration once, set up logging, then serve in this process over its own
engine processes (`server.edge.server.run`), or as several front processes over the engine processes of one
supervising parent (`--processes`, `server.edge.replicas`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from server.edge.flags import parse_config
from server.edge.logs import configure_logging
from server.edge.process_metrics import disable_created_metrics
from server.edge.replicas import run_replicas
from server.edge.server import run


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = parse_config(argv, os.environ)
    except ValueError as err:  # a bad value, as argparse's bad flag: status 2
        print(f"translate-server: {err}", file=sys.stderr)
        sys.exit(2)
    configure_logging(config.observability.log_level, config.observability.log_format)
    disable_created_metrics()
    if config.serving.processes > 1:
        sys.exit(run_replicas(config))
    run(config)


if __name__ == "__main__":
    main()
