"""A model (not a measurement) of the causal Hopper backward's tail: how far past the
ideal (total work / SMs) the grid's last programs finish, with the grid launched in the
order the kernel launches it, against orders it could take. CPU only; no kernel runs.

What it models (flashtune/kernels/attn_bwd_hopper.py, ORDER 1, causal, Sq = Sk):
- one program per (head, key tile of ``BLOCK_N`` keys), one program per SM, each
  launched when an SM is free, in grid order: head by head, and within a head from the
  last key tile to the first (``_key_tile``: a program waits only for earlier ones), so
  each head's lightest key tile first and its heaviest (key tile 0, which visits every
  query tile) last;
- a program's time is the number of query tiles it visits (``BLOCK_M`` rows each):
  ``n_m - j * BLOCK_N / BLOCK_M`` for key tile ``j``; waits for dQ turns are left out
  (with the lighter tiles launched first they are rare).

The orders: ``head-major`` (the kernel's), ``rank-major`` (every head's tile of one rank
before the next rank: the same order within a head, heads interleaved, at the price of
L2 reuse, which the model leaves out), and ``paired`` (one program walks key tiles ``j``
and ``n_n - 1 - j``, all programs the same work: the classic causal balancing, which
would need its own dQ turn order to stay free of deadlocks).

    python3 benchmarks/experiments/causal_tail_sim.py [--sms 132]

``with_turns`` adds the fixed order's waits and the ``hopper_lpt`` design (heaviest key
tile first, each walking its query tiles from the last, turns ascending: still a program
waits only for earlier ones, and tiles launched later reach each query tile later), by
head or rank by rank over groups of heads.

Session 54: head-major 1.074-1.082x the ideal at the standard causal D=128 shapes,
rank-major 1.031-1.063x, paired 1.031x (then only the last wave's quantization); with the
turns, the kernel's order 1.076-1.083x, ``hopper_lpt`` 1 1.011x at 16k but 1.061-1.085x
from 8k down, 16 1.002-1.025x, 64 1.002-1.009x. The
measured main kernel (session 53) took 0.540x the unmasked one's time at 16k, where the
causal work is 0.504x of it: the gap the model's tail and the diagonal tiles' masking
share. A hypothesis for a profile to confirm.

Session 57's profile confirmed the tail: ncu put the 16k causal main kernel's SMs idle
6.9% of its time (``bwd_ncu_calls.py``), the model's head-major 1.075x (7.0% idle).
``paired_turns`` models equal-length programs in the fixed order: 1.031-1.034x with the
heavy tile walking downwards, 1.034-1.039x upwards (and worse as a turn costs more: with
adds of 0.6 of a tile, 1.034x against 1.063x at 16k). The model's turn costs are
optimistic: ``hopper_lpt`` 1, 1.011x here, ran 8-21% slower on the GPU (session 55).

Session 67 (``split_turns``): the kernel's order and turns with each key tile's walk longer
than a threshold split into two programs at its middle (dK and dV would go to two partials
summed in order, as ``hopper_kv_rep`` does for GQA), launched head by head from the last key
tile, each tile's first half before its second. A second half starts mid-walk and waits for
every lighter key tile to pass its first query tile, holding its SM meanwhile: 1.20-1.54x
the ideal against the kernel's 1.076-1.083x at the standard causal D=128 shapes, worse the
more tiles are split. Not a route for the deterministic tail.
"""

from __future__ import annotations

import argparse
import heapq

# (seqlen, batch x heads): the standard preset's causal D=128 rows
SHAPES = ((16384, 16), (8192, 32), (4096, 64), (2048, 128), (1024, 256))


def makespan(works: list[float], sms: int) -> float:
    """When the last program ends, programs launched in order on the first free SM."""
    free = [0.0] * sms
    end = 0.0
    for w in works:
        t = heapq.heappop(free)
        heapq.heappush(free, t + w)
        end = max(end, t + w)
    return end


def orders(seqlen: int, heads: int, block_n: int, block_m: int) -> dict[str, list[float]]:
    n_n, n_m = seqlen // block_n, seqlen // block_m

    def work(j: int) -> float:
        return n_m - j * block_n // block_m

    light_first = list(reversed(range(n_n)))
    return {
        "head-major": [work(j) for _ in range(heads) for j in light_first],
        # (the free order without turns, hopper_dq_unordered: session 67)
        "head-major, heaviest first": [work(j) for _ in range(heads) for j in range(n_n)],
        "rank-major": [work(j) for j in light_first for _ in range(heads)],
        "paired": [work(j) + work(n_n - 1 - j) for _ in range(heads) for j in range(n_n // 2)],
    }


def with_turns(n_n: int, heads: int, sms: int, *, lpt: int, add: float = 0.05,
               ring: int = 2) -> float:
    """Makespan over the ideal of the fixed dQ order, its turns included: each (key tile,
    query tile) costs one unit of compute, then its dQ add (``add`` units on the program's
    writer) waits for the add ranked before it on that query tile; a consumer runs at
    most ``ring`` adds ahead of its writer. ``lpt`` 0: the kernel's order (lightest key
    tile first, head by head, walks ascending, turns descending); G > 0: ``hopper_lpt``
    G (heaviest first, walks descending, turns ascending; rank by rank over groups of G
    heads when G > 1)."""
    n_m = 2 * n_n
    if lpt == 0:
        progs = [(h, j) for h in range(heads) for j in reversed(range(n_n))]
    else:
        progs = [(h, j) for g0 in range(0, heads, lpt) for j in range(n_n)
                 for h in range(g0, min(heads, g0 + lpt))]
    done: dict[tuple[int, int, int], float] = {}
    free = [0.0] * sms
    end = busy = 0.0
    for h, j in progs:  # each waits only for programs launched before it
        t = writer = heapq.heappop(free)
        walk = range(2 * j, n_m) if lpt == 0 else range(n_m - 1, 2 * j - 1, -1)
        ends: list[float] = []
        for i, m in enumerate(walk):
            if i >= ring:
                t = max(t, ends[i - ring])
            t += 1.0
            prev = (j + 1 if j + 1 <= m // 2 else None) if lpt == 0 else (j - 1 if j else None)
            ready = done[(h, m, prev)] if prev is not None else 0.0
            writer = max(t, writer, ready) + add
            done[(h, m, j)] = writer
            ends.append(writer)
        heapq.heappush(free, max(t, writer))
        end = max(end, t, writer)
        busy += len(walk)
    return end / (busy / sms)


def split_turns(n_n: int, heads: int, sms: int, *, min_len: int = 0, add: float = 0.05,
                ring: int = 2) -> float:
    """:func:`with_turns` (the kernel's order, ``lpt`` 0) with the walk of every key tile
    that visits more than ``min_len`` query tiles split into two programs at its middle,
    launched head by head from the last key tile, each tile's first half before its second
    (each program waits only for programs launched before it)."""
    n_m = 2 * n_n
    progs = []
    for h in range(heads):
        for j in reversed(range(n_n)):
            lo = 2 * j
            cut = lo + (n_m - lo) // 2
            progs += [(h, j, lo, cut), (h, j, cut, n_m)] if n_m - lo > min_len \
                else [(h, j, lo, n_m)]
    done: dict[tuple[int, int, int], float] = {}
    free = [0.0] * sms
    end = busy = 0.0
    for h, j, lo, hi in progs:
        t = writer = heapq.heappop(free)
        ends: list[float] = []
        for i, m in enumerate(range(lo, hi)):
            if i >= ring:
                t = max(t, ends[i - ring])
            t += 1.0
            ready = done[(h, m, j + 1)] if j + 1 <= m // 2 else 0.0
            writer = max(t, writer, ready) + add
            done[(h, m, j)] = writer
            ends.append(writer)
        heapq.heappush(free, max(t, writer))
        end = max(end, t, writer)
        busy += hi - lo
    return end / (busy / sms)


def paired_turns(n_n: int, heads: int, sms: int, *, ratio: int = 2, add: float = 0.05,
                 ring: int = 2, heavy_down: bool = True, rounds: int = 100) -> float:
    """Makespan over the ideal of equal-length programs in the fixed dQ order: program p
    of a head takes key tile n_n - 1 - p (light, walking its query tiles upwards), then key
    tile p (heavy, downwards with ``heavy_down``, else upwards too). The turn order at a
    query tile is static: the units that see it sorted by their estimated arrival, in
    query-tile steps from the head's start (``ratio`` query tiles per key tile, 2 for
    64-row query tiles and 128-key tiles: light tile a at tile m: m - 2a; heavy tile p:
    2p + 2 + (n_m - 1 - m) downwards, 2p + 2 + m - 2p upwards), ties by program. Every wait
    then points to an add estimated earlier, so the waits hold no cycle while a head's
    programs are resident together. Costs as in :func:`with_turns`. A program's time
    depends on the others' starts and theirs on its end: list scheduling and the waits are
    iterated to a fixed point."""
    n_m, pairs = ratio * n_n, n_n // 2
    steps = []  # per program of a head: [(query tile, estimated arrival)]
    for p in range(pairs):
        light, heavy = n_n - 1 - p, p
        own = [(m, m - ratio * light) for m in range(ratio * light, n_m)]
        walk = (range(n_m - 1, ratio * heavy - 1, -1) if heavy_down
                else range(ratio * heavy, n_m))
        steps.append(own + [(m, len(own) + i) for i, m in enumerate(walk)])
    at: dict[int, list[tuple[int, int, int]]] = {}
    for p, st in enumerate(steps):
        for i, (m, t) in enumerate(st):
            at.setdefault(m, []).append((t, p, i))
    pred: dict[tuple[int, int], tuple[int, int]] = {}
    for lst in at.values():
        lst.sort()
        for k in range(1, len(lst)):
            pred[lst[k][1:]] = lst[k - 1][1:]
    topo = sorted((t, p, i) for p, st in enumerate(steps) for i, (_m, t) in enumerate(st))

    def head_ends(starts: list[float]) -> list[float]:
        c = [[0.0] * len(st) for st in steps]
        a = [[0.0] * len(st) for st in steps]
        for _t, p, i in topo:
            c[p][i] = max(c[p][i - 1] if i else starts[p],
                          a[p][i - ring] if i >= ring else 0.0) + 1.0
            q = pred.get((p, i))
            a[p][i] = max(c[p][i], a[p][i - 1] if i else 0.0,
                          a[q[0]][q[1]] if q else 0.0) + add
        return [max(c[p][-1], a[p][-1]) for p in range(pairs)]

    total = pairs * heads
    ends = [float(len(steps[0]))] * total  # first guess: no waits
    for _ in range(rounds):
        free = [0.0] * sms
        starts = []
        for g in range(total):  # launched in order, each on the first free SM
            t = heapq.heappop(free)
            starts.append(t)
            heapq.heappush(free, ends[g])
        # (an SM frees when its program ends; the heap holds this round's guesses)
        new = []
        for h in range(heads):
            new += head_ends(starts[h * pairs:(h + 1) * pairs])
        if new == ends:
            break
        ends = new
    busy = heads * sum(len(st) for st in steps)
    return max(ends) / (busy / sms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--block-m", type=int, default=64)
    args = ap.parse_args()
    print("| B*H x S | " + " | ".join(orders(1024, 1, args.block_n, args.block_m)) + " |")
    print("|---" * (len(orders(1024, 1, args.block_n, args.block_m)) + 1) + "|")
    for seqlen, bh in SHAPES:
        cases = orders(seqlen, bh, args.block_n, args.block_m)
        ideal = sum(cases["head-major"]) / args.sms
        print(f"| {bh} x {seqlen} | " + " | ".join(
            f"{makespan(w, args.sms) / ideal:.3f}" for w in cases.values()) + " |")
    ratio = args.block_n // args.block_m
    table("With the fixed order's turns (add = 0.05 of a tile's compute, ring 2):",
          ("kernel's order", "lpt 1", "lpt 16", "lpt 64"), args.block_n,
          lambda n_n, bh: [with_turns(n_n, bh, args.sms, lpt=g) for g in (0, 1, 16, 64)])
    table("Paired key tiles in the fixed order (static turns by estimated arrival):",
          ("heavy tile walking down", "heavy tile walking up"), args.block_n,
          lambda n_n, bh: [paired_turns(n_n, bh, args.sms, ratio=ratio, heavy_down=d)
                           for d in (True, False)])
    table("Key tiles' walks split in two programs (the kernel's order and turns):",
          ("all split", "walks > n_n tiles split", "walks > 1.5 n_n tiles split"),
          args.block_n,
          lambda n_n, bh: [split_turns(n_n, bh, args.sms, min_len=k)
                           for k in (0, n_n, 3 * n_n // 2)])


def table(title: str, columns: tuple[str, ...], block_n: int, cells) -> None:
    """A markdown table of ``cells(key tiles, batch x heads)`` for each of SHAPES."""
    print(f"\n{title}\n| B*H x S | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for seqlen, bh in SHAPES:
        print(f"| {bh} x {seqlen} | "
              + " | ".join(f"{x:.3f}" for x in cells(seqlen // block_n, bh)) + " |")

if __name__ == "__main__":
    main()
