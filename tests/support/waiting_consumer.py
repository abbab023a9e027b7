"""A consumer process for race tests: joins group ``racers`` on ``orders``, whether or not
anything was sent yet, and prints ``received <ids>`` once it has every id it waits for.

Run as ``python -m tests.support.waiting_consumer "<key=value lines>" "<id>,<id>"``.
"""

from __future__ import annotations

import sys
import time

from engine.consume.consumer import Consumer
from engine.core.config import load_config, parse_override
from engine.core.errors import ConsumerError
from engine.lakehouse.catalog.session import build_spark

WAIT_S = 240


def main(settings: str, wanted_ids: str) -> int:
    cfg = load_config(None, dict(parse_override(line) for line in settings.splitlines() if line))
    spark = build_spark(cfg)
    wanted = set(wanted_ids.split(","))
    got: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while not wanted <= set(got) and time.monotonic() < deadline:
        try:
            with Consumer(spark, cfg, "racers", ["orders"]) as consumer:
                while not wanted <= set(got) and time.monotonic() < deadline:
                    got.extend(m.msg_id for m in consumer.poll(timeout=5))
                    consumer.ack()
                    consumer.commit()
        except ConsumerError as err:  # nothing was sent to the topic yet: a user waits too
            if "unknown topic" not in str(err):
                raise
            time.sleep(1)
    print("received", " ".join(sorted(got)), flush=True)
    return 0 if wanted <= set(got) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
