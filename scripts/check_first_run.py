#!/usr/bin/env python3
"""Checks what the README's first run (scripts/demo.sh) promises, on a run directory:

  1. learning: the last validation loss in RUN_DIR/metrics.jsonl is at least --min-gap nats below
     the bigram baseline the trainer recorded beside it (the "eval" event's bigram_loss);
  2. English: of the words in the samples, at least --min-words (a fraction) occur in the corpus.
     Words are runs of letters (with inner apostrophes: don't), compared lower-cased, with the
     separator <|endoftext|> taken out of the samples first; the corpus
     words are those of every file under --corpus (strfile indexes *.dat left out).
     The samples are --sample-file's text (e.g. `blutrain sample`'s output) where given, else the
     last sample event of metrics.jsonl.

Prints the numbers and exits 1 when a check fails (2 on unusable input).
Usage: check_first_run.py RUN_DIR [--corpus DIR_OR_FILE] [--sample-file FILE] [--min-gap 0.4]
                                  [--min-words 0.8] [--min-word-count 20]
"""
import argparse
import json
import os
import re
import sys

WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


def words(text):
    return [w.lower() for w in WORD.findall(text.replace("<|endoftext|>", "\n"))]


def corpus_words(path):
    vocab = set()
    files = [path] if os.path.isfile(path) else [
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if not f.endswith(".dat")]
    for f in sorted(files):
        with open(f, "rb") as fh:
            vocab.update(words(fh.read().decode("utf-8", "replace")))
    return vocab


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--corpus", default="/usr/share/games/fortunes")
    ap.add_argument("--sample-file")
    ap.add_argument("--min-gap", type=float, default=0.4)
    ap.add_argument("--min-words", type=float, default=0.8)
    ap.add_argument("--min-word-count", type=int, default=20)
    a = ap.parse_args()

    metrics = os.path.join(a.run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        print(f"check_first_run: no {metrics}", file=sys.stderr)
        return 2
    evals, samples = [], []
    with open(metrics) as f:
        for line in f:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "eval" and "bigram_loss" in e:
                evals.append(e)
            elif e.get("event") == "sample":
                samples.append(e)
    if not evals:
        print(f"check_first_run: {metrics} has no eval event with a bigram_loss", file=sys.stderr)
        return 2
    ok = True
    last = evals[-1]
    gap = last["bigram_loss"] - last["val_loss"]
    good = gap >= a.min_gap
    ok &= good
    print(f"step {last['step']}: val loss {last['val_loss']:.4f}, bigram {last['bigram_loss']:.4f}, "
          f"unigram {last.get('unigram_loss', float('nan')):.4f}: {gap:.4f} below the bigram "
          f"(needs >= {a.min_gap}) {'ok' if good else 'FAIL'}")

    if a.sample_file:
        with open(a.sample_file, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        where = a.sample_file
    elif samples:
        text, where = samples[-1]["text"], f"the sample at step {samples[-1]['step']}"
    else:
        print("check_first_run: no sample (no --sample-file, no sample event)", file=sys.stderr)
        return 2
    sample_words = words(text)
    if len(sample_words) < a.min_word_count:
        print(f"{where}: {len(sample_words)} words, fewer than --min-word-count {a.min_word_count} FAIL")
        return 1
    vocab = corpus_words(a.corpus)
    if not vocab:
        print(f"check_first_run: no words in the corpus {a.corpus}", file=sys.stderr)
        return 2
    unknown = [w for w in sample_words if w not in vocab]
    frac = 1 - len(unknown) / len(sample_words)
    good = frac >= a.min_words
    ok &= good
    print(f"{where}: {len(sample_words) - len(unknown)} of {len(sample_words)} words ({frac:.1%}) occur in "
          f"{a.corpus} (needs >= {a.min_words:.0%}) {'ok' if good else 'FAIL'}")
    if unknown:
        print("  not in the corpus: " + " ".join(sorted(set(unknown))[:30]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
