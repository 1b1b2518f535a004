#!/usr/bin/env python3
"""The n-gram baselines of data/ngram_baseline.h, written out in plain Python as the test's
reference: add-one smoothed unigram and bigram counts of the training shards (one stream, at most
MAX_TOKENS tokens; 0 = all), scored on every consecutive pair of the validation shard.

Usage: ngram_baseline_reference.py VOCAB MAX_TOKENS VAL_SHARD TRAIN_SHARD...
Prints {"unigram": ..., "bigram": ..., "pairs": ...} (mean nats per pair).
"""
import json
import math
import struct
import sys
from collections import Counter


def read_shard(path):
    with open(path, "rb") as f:
        data = f.read()
    magic, version, n = struct.unpack_from("<3i", data, 0)
    assert magic == 20240520 and version == 1, path
    return list(struct.unpack_from(f"<{n}H", data, 1024))


def main():
    vocab, max_tokens = int(sys.argv[1]), int(sys.argv[2])
    val = read_shard(sys.argv[3])
    stream = []
    for path in sys.argv[4:]:
        stream += read_shard(path)
    if max_tokens > 0:
        stream = stream[:max_tokens]
    uni = Counter(stream)
    pairs = Counter(zip(stream, stream[1:]))
    ctx = Counter(stream[:-1])
    n = len(stream)
    u = b = 0.0
    for a, t in zip(val, val[1:]):
        u -= math.log((uni[t] + 1) / (n + vocab))
        b -= math.log((pairs[(a, t)] + 1) / (ctx[a] + vocab))
    k = len(val) - 1
    print(json.dumps({"unigram": u / k, "bigram": b / k, "pairs": k}))


if __name__ == "__main__":
    main()
