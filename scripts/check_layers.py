#!/usr/bin/env python3
"""Checks that src/blu's includes point down the layers only (docs/design.md, "Layers and include
direction"): a file under src/blu/<layer>/ may include "blu/<other>/..." only when <other> sits
below <layer> or is <layer> itself. Prints every upward include and exits 1 when there is one.

Usage: check_layers.py [SOURCE_DIR]   (default: the repository holding this script)
Run by ctest (Layering.IncludesPointDown, label cpu).
"""
import pathlib
import re
import sys

# Lowest first. A layer may include its own folder and everything listed before it.
LAYERS = ["core", "memory", "backend", "ops"]
RANK = {name: i for i, name in enumerate(LAYERS)}
INCLUDE = re.compile(r'^\s*#\s*include\s*"blu/([A-Za-z0-9_]+)/')
SUFFIXES = {".h", ".cpp", ".cu", ".cuh"}


def upward_includes(src: pathlib.Path):
    for path in sorted(src.rglob("*")):
        if path.suffix not in SUFFIXES or not path.is_file():
            continue
        layer = path.relative_to(src).parts[0]
        if layer not in RANK:
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = INCLUDE.match(line)
            if m and m.group(1) in RANK and RANK[m.group(1)] > RANK[layer]:
                yield f"{path}:{lineno}: {layer}/ includes {m.group(1)}/ (above it): {line.strip()}"


def main() -> int:
    root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent
    src = root / "src" / "blu"
    if not src.is_dir():
        print(f"check_layers: no {src}", file=sys.stderr)
        return 2
    bad = list(upward_includes(src))
    for b in bad:
        print(b)
    if bad:
        print(f"check_layers: {len(bad)} upward include(s); the order, lowest first: {' < '.join(LAYERS)}")
        return 1
    print(f"check_layers: includes point down ({' < '.join(LAYERS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
