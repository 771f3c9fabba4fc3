"""Shared by the benchmark scripts: the reference side's token ids, and the helpers that start and
measure `hrm serve`."""

import json
import socket
import urllib.request

MASK64 = (1 << 64) - 1


def bench_ids(batch, length, vocab):
    """The token ids `hrm bench` feeds (crates/hrm-cli/src/bench/model.rs, `bench_ids`): a fixed
    pseudo-random walk, so both sides see exactly the same input."""
    state = 0x2545F4914F6CDD1D
    rows = []
    for _ in range(batch):
        row = []
        for _ in range(length):
            state = (state * 6364136223846793005 + 1442695040888963407) & MASK64
            row.append((state >> 33) % vocab)
        rows.append(row)
    return rows


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base, path, body, timeout=300):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.load(r)


def rss_mb(pid, field="VmRSS"):
    """A process's resident memory (`VmRSS`, or its peak `VmHWM`), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return None
