"""The client side of `verity bench serve`: N concurrent clients send R chat completions in all
to one OpenAI-compatible server on loopback, and one JSON line reports throughput and latency.

Every request asks for exactly --max-tokens tokens (EOS ids biased away, so both servers
generate the same count) and is non-streaming; throughput is completion tokens over the wall
time of the level. Loopback only: any other host is refused. Every request has a timeout, and
the run ends after R requests.
"""

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse

PROMPTS = [
    "Tell me about rivers.",
    "Write a function that reads a file.",
    "What does the function os.path.join do?",
    "Explain recursion briefly.",
    "Describe the sea at night.",
    "List the planets of the solar system.",
    "How does a compiler work?",
    "Write a short poem about trees.",
]


def post(url, body, timeout):
    """One request on its own connection, through http.client rather than urllib: urlopen's
    per-call opener and handlers, contending for the GIL across 32 client threads, delayed
    requests by about 0.6 s on a 16-core host (docs/gpu-rows.md), which the servers' numbers
    then carried."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", u.path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
        return json.loads(data)
    finally:
        conn.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True, help="the server's base URL (loopback only)")
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--eos", type=int, action="append", default=[], help="token ids to bias away")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    a = p.parse_args()
    host = urllib.parse.urlparse(a.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"bench_serve.py: {a.url} is not a loopback address")
    if a.clients < 1 or a.requests < 1 or a.max_tokens < 1:
        sys.exit("bench_serve.py: --clients, --requests and --max-tokens must be at least 1")
    url = a.url.rstrip("/") + "/v1/chat/completions"
    bias = {str(t): -100 for t in a.eos}
    latencies, tokens, errors = [], [], []
    lock = threading.Lock()
    counter = iter(range(a.requests))

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            body = {
                "model": "default_model",
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": a.max_tokens,
                "temperature": 0.0,
                "logit_bias": bias,
            }
            start = time.perf_counter()
            try:
                v = post(url, body, a.timeout)
                n = v["usage"]["completion_tokens"]
            except Exception as e:  # reported, never retried
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens.append(n)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else None
    print(
        json.dumps(
            {
                "clients": a.clients,
                "requests": len(latencies),
                "errors": errors,
                "wall_s": wall,
                "completion_tokens": sum(tokens),
                "tok_s": sum(tokens) / wall,
                "p50_s": q[49] if q else (latencies[0] if latencies else None),
                "p99_s": q[98] if q else (latencies[0] if latencies else None),
            }
        )
    )


if __name__ == "__main__":
    main()
