"""The engine side of `verity judge` (docs/judge.md) that every adapter shares: read the requests,
answer each case that is not a skip with the adapter's `answer`, turn a refusal or an engine
failure into that case's `unsupported` answer, and write the responses atomically. Imports
nothing of any engine, so an adapter's own venv (transformers has no MLX) can use it.
"""

import argparse
import json
import os
from pathlib import Path


class Unsupported(Exception):
    """A case the adapter's engine cannot answer, and why."""


def answer_all(doc, engine, answer, progress=lambda cases: cases):
    """The adapter's command line: REQUESTS RESPONSES. `answer(request)` gives a response's body;
    `progress` may wrap the list of requests (a progress bar)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("requests", type=Path)
    ap.add_argument("responses", type=Path)
    args = ap.parse_args()
    requests = [json.loads(line) for line in args.requests.read_text().splitlines() if line.strip()]
    lines = []
    for req in progress(requests):
        if req["mode"] == "skip":
            continue
        try:
            response = {"id": req["id"], **answer(req)}
        except Unsupported as e:
            response = {"id": req["id"], "unsupported": str(e)}
        except Exception as e:  # noqa: BLE001 - any engine failure is this case's answer
            response = {"id": req["id"], "unsupported": f"{engine} raised {type(e).__name__}: {e}"}
        lines.append(json.dumps(response))
    tmp = args.responses.with_name(f".{args.responses.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, args.responses)
