"""`python -m libs.natsd`: run one nats-server in the foreground until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from libs.natsd.server import start_nats_server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libs.natsd", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4222, help="client port; 0 picks a free one")
    p.add_argument("--store-dir", default=None, help="JetStream store (default: a temporary directory)")
    p.add_argument("--no-jetstream", action="store_true")
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = start_nats_server(args.port, not args.no_jetstream, args.store_dir, args.host)
    print(f"nats-server ready at {server.url} (monitoring {server.monitor_url})", flush=True)
    try:
        while not stop.is_set() and server.is_running():
            stop.wait(0.5)  # wakes at once on a signal; the timeout only notices a server that died
        if not server.is_running():
            print(
                f"nats-server exited with code {server.proc.returncode}:\n{server.log_text()}",
                file=sys.stderr,
            )
            return 1
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
