"""`python -m workers`: run one reward worker until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from app.config import get_settings, refuse_development_secrets
from app.metrics import serve_metrics
from workers.config import WorkerConfig
from workers.consumer import run_worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument("--completions-topic")
    parser.add_argument("--feedback-topic")
    parser.add_argument("--dlq-topic")
    parser.add_argument("--group-id")
    parser.add_argument("--max-records", type=int)
    parser.add_argument("--sweep-interval-s", type=float)
    parser.add_argument("--monitor-interval-s", type=float)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Read the settings and options, then consume until told to stop."""
    args = parse_args(argv)
    level = logging.getLevelName(args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # kafka-python's debug output is per request; the worker's own debug lines are per batch.
    logging.getLogger("kafka").setLevel(max(level, logging.INFO))
    overrides = {
        name: value
        for name, value in vars(args).items()
        if name != "log_level" and value is not None
    }
    settings = get_settings()
    refuse_development_secrets(settings)
    serve_metrics(settings.metrics_port)
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    run_worker(settings, stop_event=stop, config=WorkerConfig.from_settings(settings, **overrides))


if __name__ == "__main__":
    main()
