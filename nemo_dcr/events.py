"""The JSON event lines that receivers (``nemo-dcr receive``, the follower, the background
follower) and relays (``nemo-dcr relay``) print: :func:`event_line` stamps each with
``"ts"``, wall-clock Unix seconds rounded to milliseconds, so that the logs of a tree's
processes (one machine or several with synchronized clocks) can be lined up: when each
relay first held a version, when each receiver answered it."""
from __future__ import annotations

import json
import time


def event_line(event: dict) -> str:
    """``event`` as one JSON line, ``"ts"`` last (an event's own ``ts`` is replaced)."""
    return json.dumps({**{k: v for k, v in event.items() if k != "ts"}, "ts": round(time.time(), 3)})


def size_text(nbytes: int) -> str:
    """Bytes for people: ``512 B``, ``33.7 kB``, ``5.1 MB``, ``2.3 GB`` (powers of 1000), as
    the trainer's and the receiver's line per decided version give them."""
    n = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
