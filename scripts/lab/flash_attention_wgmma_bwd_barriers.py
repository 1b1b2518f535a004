#!/usr/bin/env python3
"""Model check of the named-barrier protocol of the wgmma backward (flash_attention_wgmma_backward.cu,
Note [wgmma backward pipeline]), on the CPU: the shipping kernel (2 stages, a tile's stage released at
the tile's end) and the pipelined lab variant (flash_attention_wgmma_bwd_pipe.patch: 3 stages,
released in the next tile).

Three actors (producer, consumer 0, consumer 1) run their barrier programs under random
interleavings. A named barrier completes a phase when every warpgroup it counts has arrived (arrive
or sync); sync blocks until that phase completes. Checks: no deadlock, no warpgroup arriving twice in
one phase (it would be counted into the wrong phase), every barrier idle at exit, and the data
hand-off: the producer refills a stage only after both consumers released the tile in it, and a
consumer reads a stage only when it holds the consumer's tile. Usage: python3 this.py
"""
import random


def programs(n, pipe):
    ns = 3 if pipe else 2
    full = lambda s: ("FULL", s)
    empty = lambda s: ("EMPTY", s)
    prod = []
    for i in range(n):
        if i >= 1:
            prod.append(("arrive", full((i - 1) % ns)))
        if i >= ns:
            prod.append(("sync", empty(i % ns)))
        prod.append(("write", i % ns, i))
    prod.append(("arrive", full((n - 1) % ns)))
    cons = []
    for i in range(n):
        st = i % ns
        cons.append(("sync", full(st)))
        cons.append(("read", st, i))
        if pipe and i >= 1 and i - 1 + ns < n:
            cons.append(("release", (i - 1) % ns, i - 1))
            cons.append(("arrive", empty((i - 1) % ns)))
        cons.append(("sync", ("DS", 0)))
        if not pipe and i + ns < n:
            cons.append(("release", st, i))
            cons.append(("arrive", empty(st)))
    return ns, [prod, list(cons), list(cons)]


def members(bar):
    return {0, 1} if bar[0] == "DS" else {"P", 0, 1}


def run(n, pipe, rng):
    ns, progs = programs(n, pipe)
    names = ["P", 0, 1]
    pc = [0, 0, 0]
    arrived = {}   # bar -> set of actors arrived in the current phase
    phase = {}     # bar -> completed phases
    waiting = {}   # actor index -> (bar, phase it waits to complete)
    stage_tile = {}  # stage -> tile written there
    released = {}  # (stage, tile) -> set of consumers done with it
    while True:
        ready = [a for a in range(3) if pc[a] < len(progs[a]) and
                 (a not in waiting or phase.get(waiting[a][0], 0) > waiting[a][1])]
        for a in list(waiting):
            if phase.get(waiting[a][0], 0) > waiting[a][1]:
                del waiting[a]
                pc[a] += 1
        ready = [a for a in range(3) if pc[a] < len(progs[a]) and a not in waiting]
        if not ready:
            break
        a = rng.choice(ready)
        op = progs[a][pc[a]]
        who = names[a]
        if op[0] in ("arrive", "sync"):
            bar = op[1]
            got = arrived.setdefault(bar, set())
            assert who not in got, f"{who} arrives twice in one phase of {bar} (n={n}, pipe={pipe})"
            got.add(who)
            ph = phase.get(bar, 0)
            if got == members(bar):
                phase[bar] = ph + 1
                arrived[bar] = set()
            if op[0] == "sync":
                waiting[a] = (bar, ph)
                continue
        elif op[0] == "write":
            _, st, tile = op
            if tile >= ns:
                assert released.get((st, tile - ns)) == {0, 1}, f"stage {st} refilled before tile {tile - ns} released"
            stage_tile[st] = tile
        elif op[0] == "read":
            _, st, tile = op
            assert stage_tile.get(st) == tile, f"consumer {who} reads stage {st} for tile {tile}, holds {stage_tile.get(st)}"
        elif op[0] == "release":
            released.setdefault((op[1], op[2]), set()).add(who)
        pc[a] += 1
    stuck = [names[a] for a in range(3) if pc[a] < len(progs[a])]
    assert not stuck, f"deadlock: {stuck} blocked at {[progs[a][pc[a]] for a in range(3) if pc[a] < len(progs[a])]} (n={n}, pipe={pipe})"
    for bar, got in arrived.items():
        assert not got, f"barrier {bar} left half-arrived by {got} (n={n}, pipe={pipe})"


def main():
    rng = random.Random(1)
    runs = 0
    for pipe in (False, True):
        for n in range(1, 12):
            for _ in range(300):
                run(n, pipe, rng)
                runs += 1
    print(f"wgmma backward barrier protocol: {runs} random schedules, no deadlock or hazard")


if __name__ == "__main__":
    main()
