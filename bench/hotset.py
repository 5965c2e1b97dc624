#!/usr/bin/env python3
"""Writes the URL list of the hot-set scenario (d) for `oha --urls-from-file`.

oha picks a line at random for every request, so a key's share of the traffic
is its share of the lines: key k (1-based) gets round(lines * (1/k^s) / H)
lines (at least one), H the normalising sum, i.e. a Zipf mix over `keys` keys.

    bench/hotset.py BASE_URL [--keys 10000] [--lines 200000] [--s 1.0] [--query Q]

Prints one URL per line: BASE_URL/<k>?Q, in a shuffled, seeded order.
"""
import argparse
import random
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--s", type=float, default=1.0)
    ap.add_argument("--query", default="max-age=86400&size=1024")
    ap.add_argument("--seed", type=int, default=4)
    a = ap.parse_args()
    weights = [1.0 / (k**a.s) for k in range(1, a.keys + 1)]
    total = sum(weights)
    out = []
    for k, w in enumerate(weights, start=1):
        out.extend([f"{a.base}/{k}?{a.query}"] * max(1, round(a.lines * w / total)))
    random.Random(a.seed).shuffle(out)
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
