#!/usr/bin/env python3
"""`hrm serve` under a careless and hostile mixed load, measured on this machine.

    python3 benches/soak_bench.py --hrm target/release/hrm [--model models/sample] [--seconds 90]

Starts `hrm serve` itself (CPU, --max-batch-size 8, a token budget of --max-queued-tokens that
the load fills), warms it up with --warmup-seconds of the mixed load (not measured), and reports,
as one JSON object. --slow-sockets slow-loris sockets (200) stay connected from the warm-up to the
shutdown, sending a header byte every few seconds and reconnecting when cut off.
  * idle_probe        latency of a one-token /generate on the idle server (p50, p99, max)
  * flood_probe       the same probe, every 0.25 s, for --flood-seconds of /loglikelihood floods
                      of 256 prompts of about 800 tokens: one client sends them and leaves after
                      1 s (as in the report that measured 610 s for the probe), another waits
                      for its answers (goal: p99 under 1 s)
  * mixed_probe       the probe during --seconds of everything at once: the floods, short and
                      long /generate requests, /generate_stream streams read to the end,
                      /v1/completions with echo and logprobs, requests whose clients leave at a
                      random moment
  * load              answers of both phases, counted by kind and status
  * server_errors     5xx answers, and those that are not one of the documented 503s (goal: 0)
  * rss_mb            resident memory after the warm-up, at the peak, and once the load has
                      drained (goal: drift under 5%)
  * slow_loris        how often the server cut a slow socket off, in both phases
  * cancelled         requests the server dropped because their client left (/metrics)
  * shutdown          SIGTERM while the slow-loris sockets are connected and a request is in
                      flight: seconds to exit, against --shutdown-timeout, and the exit code
  * panics            "panicked" lines in the server's log (goal: 0)
Uses only the Python standard library; it is a benchmark, not a test, and is not run in CI.
"""

import argparse
import collections
import http.client
import json
import random
import re
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

from common import free_port, rss_mb

WORDS = ("the king said unto them that the people of the land were gathered in the city and "
         "the house of the lord was full of light as it was in the days of old").split()

# The server errors the API documents (docs/api.md): anything else of 500 or more is a fault.
DOCUMENTED_503 = {"not_ready", "scheduler_restarting"}


def text(words, seed):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def percentiles(values):
    if not values:
        return None
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]
    return {"n": len(values), "p50_s": round(statistics.median(values), 4), "p99_s": round(pick(0.99), 4),
            "max_s": round(values[-1], 4)}


class Tally:
    """Answers by kind and status, and the server errors among them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = collections.defaultdict(collections.Counter)
        self.server_errors = []

    def add(self, kind, status, body=b""):
        with self.lock:
            self.counts[kind][str(status)] += 1
            if isinstance(status, int) and status >= 500:
                try:
                    code = json.loads(body)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = None
                self.server_errors.append({"kind": kind, "status": status, "code": code})


def request(base, path, body, timeout):
    """(status, body bytes), or the exception's name when the client gave up or failed."""
    host, port = base[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    except (TimeoutError, socket.timeout):
        return "client_left", b""
    except (ConnectionError, http.client.HTTPException) as e:
        return type(e).__name__, b""
    finally:
        conn.close()


def probe(base, timeout=60):
    t = time.perf_counter()
    status, body = request(base, "/generate", {"prompts": ["the king said"], "max_tokens": 1, "temperature": 0}, timeout)
    return status, body, time.perf_counter() - t


def metric(base, name):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        page = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name) and not line.startswith("#"))


class SlowLoris:
    """Sockets that hold half-sent headers, one byte every few seconds; a socket the server cuts
    off is opened again."""

    def __init__(self, port, count):
        self.port, self.count = port, count
        self.sockets, self.reconnects = [], 0
        self.done = threading.Event()

    def connect(self):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: soak\r\n")
        return s

    def run(self):
        self.sockets = [self.connect() for _ in range(self.count)]
        while not self.done.is_set():
            for i, s in enumerate(self.sockets):
                try:
                    s.sendall(b"X")
                except OSError:
                    s.close()
                    self.reconnects += 1
                    try:
                        self.sockets[i] = self.connect()
                    except OSError:
                        pass
            self.done.wait(3)

    def close(self):
        for s in self.sockets:
            s.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hrm", default="target/release/hrm")
    p.add_argument("--model", default="models/sample")
    p.add_argument("--seconds", type=float, default=90.0, help="the mixed load")
    p.add_argument("--warmup-seconds", type=float, default=30.0,
                   help="the mixed load before the memory baseline, not measured")
    p.add_argument("--flood-seconds", type=float, default=30.0, help="the scoring flood alone, first")
    p.add_argument("--max-queued-tokens", type=int, default=300_000,
                   help="the server's token budget: one scoring flood fits, a second does not")
    p.add_argument("--shutdown-timeout", type=int, default=10)
    p.add_argument("--slow-sockets", type=int, default=200)
    args = p.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="hrm-soak-", suffix=".log", delete=False)
    server = subprocess.Popen(
        [args.hrm, "serve", "--host", "127.0.0.1", "--port", str(port), "--model-path", args.model,
         "--device", "cpu", "--max-batch-size", "8", "--max-queued-tokens", str(args.max_queued_tokens),
         "--shutdown-timeout", str(args.shutdown_timeout), "--log-level", "warn"],
        stderr=log)
    report = {"model": args.model, "seconds": args.seconds, "max_queued_tokens": args.max_queued_tokens,
              "log": log.name}
    try:
        for _ in range(2400):
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        flood = [text(800, 1000 + i) for i in range(256)]
        flood_workers = {
            # The report's flood: the client leaves after 1 s and sends it again ...
            "score_flood_abandoned": lambda n: ("/loglikelihood", {"prompts": flood, "continuations": [" the king"] * 256}, 1.0),
            # ... and one that waits for its answer.
            "score_flood": lambda n: ("/loglikelihood", {"prompts": flood, "continuations": [" the lord"] * 256}, None),
        }
        mixed_workers = {
            **flood_workers,
            "generate_short": lambda n: ("/generate", {"prompts": [text(12, n)], "max_tokens": 4, "temperature": 0}, None),
            "generate_long": lambda n: ("/generate", {"prompts": [text(40, n + i) for i in range(4)], "max_tokens": 128}, None),
            "stream": lambda n: ("/generate_stream", {"prompts": [text(20, n)], "max_tokens": 64}, None),
            "completions_echo_logprobs": lambda n: ("/v1/completions", {"prompt": [text(30, n + i) for i in range(8)], "max_tokens": 8, "echo": True, "logprobs": 5}, None),
            "random_disconnect": lambda n: ("/v1/completions" if n % 2 else "/generate",
                                            {"prompt": [text(30, n)], "max_tokens": 64} if n % 2 else {"prompts": [text(30, n)], "max_tokens": 64},
                                            random.uniform(0.05, 1.5)),
        }
        peak = [0.0]

        def run_load(workers, seconds, tally):
            """The workers' loops and the one-token probe for `seconds`, then every answer still
            owed to a waiting client; the probe's latencies."""
            done, probes = threading.Event(), []

            def loop(kind, make):
                n = 0
                while not done.is_set():
                    path, body, patience = make(n)
                    status, answer = request(base, path, body, patience or 900)
                    tally.add(kind, status, answer)
                    if status == 429:
                        done.wait(0.5)
                    n += 1

            def probe_loop():
                while not done.is_set():
                    status, body, seconds = probe(base)
                    tally.add("probe", status, body)
                    if status == 200:
                        probes.append(seconds)
                    done.wait(0.25)

            threads = [threading.Thread(target=loop, args=item, daemon=True) for item in workers.items()]
            threads.append(threading.Thread(target=probe_loop, daemon=True))
            started = time.perf_counter()
            for th in threads:
                th.start()
            while time.perf_counter() - started < seconds:
                time.sleep(1)
                peak[0] = max(peak[0], rss_mb(server.pid))
            done.set()
            # Each loop ends once its last request is answered, so late answers are counted too.
            for th in threads:
                th.join()
            return probes

        def drained():
            """Waits until the server holds no work."""
            for _ in range(600):
                with urllib.request.urlopen(base + "/readyz", timeout=30) as r:
                    if json.load(r)["queued_tokens"] == 0:
                        return
                time.sleep(0.5)

        # Warm-up: the mixed load once, slow sockets too, so that the allocator's pools, the
        # caches and the connections have reached their working size before the memory baseline
        # is taken; then the idle figures. The slow sockets stay until the shutdown.
        loris = SlowLoris(port, args.slow_sockets)
        loris_thread = threading.Thread(target=loris.run, daemon=True)
        loris_thread.start()
        run_load(mixed_workers, args.warmup_seconds, Tally())
        drained()
        idle = [probe(base)[2] for _ in range(40)]
        report["idle_probe"] = percentiles(idle)
        rss_start = rss_mb(server.pid)
        peak[0] = rss_start
        tally = Tally()

        # The scoring flood, as the report measured it; then everything at once.
        loris.reconnects = 0
        report["flood_probe"] = percentiles(run_load(flood_workers, args.flood_seconds, tally))
        report["mixed_probe"] = percentiles(run_load(mixed_workers, args.seconds, tally))
        report["load"] = {kind: dict(c) for kind, c in sorted(tally.counts.items())}
        report["server_errors"] = {
            "total": len(tally.server_errors),
            "undocumented": [e for e in tally.server_errors
                             if not (e["status"] == 503 and e["code"] in DOCUMENTED_503)],
        }
        report["slow_loris"] = {"sockets": args.slow_sockets, "cut_off_and_reopened": loris.reconnects}
        drained()
        rss_end = rss_mb(server.pid)
        report["rss_mb"] = {"start": round(rss_start, 1), "peak": round(peak[0], 1), "end": round(rss_end, 1),
                            "drift": round(rss_end / rss_start - 1, 4)}
        report["cancelled"] = {kind: metric(base, f'hrm_requests_cancelled_total{{kind="{kind}"}}')
                               for kind in ("generate", "score")}

        # SIGTERM with the slow sockets still connected and a long request in flight.
        in_flight = {}

        def long_request():
            in_flight["status"], _ = request(base, "/generate", {"prompts": [text(20, 7)], "max_tokens": 64}, 600)

        th = threading.Thread(target=long_request)
        th.start()
        time.sleep(0.5)
        t = time.perf_counter()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=args.shutdown_timeout + 60)
        report["shutdown"] = {"seconds_to_exit": round(time.perf_counter() - t, 2),
                              "shutdown_timeout": args.shutdown_timeout, "exit_code": code}
        th.join()
        report["shutdown"]["in_flight_request"] = in_flight.get("status")
        loris.done.set()
        loris_thread.join()
        loris.close()
    finally:
        if server.poll() is None:
            server.kill()
    with open(log.name) as f:
        report["panics"] = len(re.findall("panicked", f.read()))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
