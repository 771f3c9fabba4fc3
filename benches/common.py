"""Shared by the reference-side benchmark scripts."""

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
