"""The Hopper forward's mbarrier protocol, replayed on the CPU: can the serial consumer, the
deferred O store (``defer_o``) or the overlapped consumer (``tile_overlap``) deadlock?

Gluon kernels do not run in the interpreter, and a barrier slip hangs the GPU. This
transcribes the waits and arrivals of ``flashtune/kernels/attn_fwd_hopper.py`` (the
producer, ``_consumer_serial`` with and without DEFER_O, ``_consumer_overlapped``) into
Python generators and runs them under a random scheduler, with mbarriers modelled as
the hardware has them: an arrival count per phase, and a wait on a parity that returns
once the phase of that parity has completed (so a fresh barrier passes a wait on parity
1). TMA loads complete on their barrier at a random later step; products and stores have
no barrier of their own and are not modelled. Each run draws a tile sequence (how many
key tiles each of a program's tiles sees, zero included), the ring depth, the consumer
count and ping-pong, and checks that every partition finishes, every consumer's tiles
read each K/V tile in order, and no Q buffer is refilled while a consumer still reads it
(its own or its O store's). A deadlock or a violation prints the case and stops.

    python benchmarks/experiments/fwd_tile_end_sim.py --runs 20000

This checks the protocol as transcribed, not the compiled kernel: the transcription is
kept next to the code it follows (same order of operations, the same parities).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Generator
from typing import Any


class Bar:
    """An mbarrier: ``count`` arrivals complete a phase."""

    def __init__(self, count: int, name: str) -> None:
        self.count, self.name = count, name
        self.pending = 0
        self.done = 0  # completed phases

    def arrive(self) -> None:
        self.pending += 1
        if self.pending == self.count:
            self.pending = 0
            self.done += 1

    def passes(self, parity: int) -> bool:
        # try_wait.parity: true once the phase of that parity has completed, i.e. while the
        # phase in progress has the other parity.
        return self.done % 2 != parity


Step = Generator[tuple[Any, ...], None, None]


class World:
    def __init__(self, tiles: list[int], stages: int, consumers: int, pingpong: bool,
                 q_bufs: int, rng: random.Random) -> None:
        self.tiles, self.stages, self.consumers = tiles, stages, consumers
        self.pingpong, self.q_bufs, self.rng = pingpong, q_bufs, rng
        qn = q_bufs * consumers
        self.q_full = [Bar(1, f"q_full{i}") for i in range(qn)]
        self.q_empty = [Bar(1, f"q_empty{i}") for i in range(qn)]
        self.k_full = [Bar(1, f"k_full{i}") for i in range(stages)]
        self.v_full = [Bar(1, f"v_full{i}") for i in range(stages)]
        self.k_empty = [Bar(consumers, f"k_empty{i}") for i in range(stages)]
        self.v_empty = [Bar(consumers, f"v_empty{i}") for i in range(stages)]
        self.turn = [Bar(1, f"turn{i}") for i in range(2)]
        self.inflight: list[tuple[int, Bar, Any]] = []  # TMA loads: (due step, bar, what)
        self.k_slot: list[int | None] = [None] * stages  # K/V index held by each ring slot
        self.v_slot: list[int | None] = [None] * stages
        self.q_slot: list[int | None] = [None] * qn  # tile held by each Q buffer slot
        self.q_busy = [False] * qn  # a consumer (or its O store) still uses the buffer
        self.step = 0

    def tma(self, bar: Bar, what: Any) -> None:
        self.inflight.append((self.step + self.rng.randint(1, 6), bar, what))

    def land(self) -> None:
        keep = []
        for due, bar, what in self.inflight:
            if due <= self.step:
                kind, slot, value = what
                if kind == "q":
                    if self.q_busy[slot]:
                        raise AssertionError(f"Q buffer {slot} refilled while in use")
                    self.q_slot[slot] = value
                else:
                    getattr(self, f"{kind}_slot")[slot] = value
                bar.arrive()
            else:
                keep.append((due, bar, what))
        self.inflight = keep


def producer(w: World) -> Step:
    kv = 0
    for t, n in enumerate(w.tiles):
        slot = (t % w.q_bufs) * w.consumers
        for c in range(w.consumers):
            yield ("wait", w.q_empty[slot + c], ((t // w.q_bufs) & 1) ^ 1)
            w.tma(w.q_full[slot + c], ("q", slot + c, t))
        for _ in range(n):
            buf, phase = kv % w.stages, ((kv // w.stages) & 1) ^ 1
            yield ("wait", w.k_empty[buf], phase)
            w.tma(w.k_full[buf], ("k", buf, kv))
            yield ("wait", w.v_empty[buf], phase)
            w.tma(w.v_full[buf], ("v", buf, kv))
            kv += 1


class Consumer:
    """The state a consumer partition keeps, and the checks on what it reads."""

    def __init__(self, w: World, cid: int) -> None:
        self.w, self.cid, self.turns = w, cid, 0

    def take_turn(self) -> Step:
        if self.w.pingpong:
            yield ("wait", self.w.turn[self.cid], (self.turns & 1) ^ (1 - self.cid))

    def give_turn(self) -> None:
        if self.w.pingpong:
            self.w.turn[1 - self.cid].arrive()
            self.turns += 1

    def read_k(self, cnt: int) -> None:
        assert self.w.k_slot[cnt % self.w.stages] == cnt, f"K {cnt} not in its slot"

    def read_v(self, cnt: int) -> None:
        assert self.w.v_slot[cnt % self.w.stages] == cnt, f"V {cnt} not in its slot"

    def read_q(self, slot: int, t: int) -> None:
        assert self.w.q_slot[slot] == t, f"Q buffer {slot} holds {self.w.q_slot[slot]}, not {t}"

    def steady(self, kv: int, n: int, q_slot: int, t: int) -> Step:
        """_steady_state: key tiles 1 .. n - 1."""
        w = self.w
        for j in range(1, n):
            cnt = kv + j
            buf, pbuf = cnt % w.stages, (cnt - 1) % w.stages
            yield ("wait", w.k_full[buf], (cnt // w.stages) & 1)
            yield ("wait", w.v_full[pbuf], ((cnt - 1) // w.stages) & 1)
            yield from self.take_turn()
            self.read_q(q_slot, t)
            self.read_k(cnt)
            self.read_v(cnt - 1)
            self.give_turn()
            w.k_empty[buf].arrive()
            w.v_empty[pbuf].arrive()


def serial(w: World, cid: int, defer: bool) -> Step:
    """_consumer_serial (dense), with or without DEFER_O."""
    me = Consumer(w, cid)
    kv = 0
    for t, n in enumerate(w.tiles):
        q_slot = (t % w.q_bufs) * w.consumers + cid
        if defer and n == 0 and t > 0:
            _release(w, t, cid)
        yield ("wait", w.q_full[q_slot], (t // w.q_bufs) & 1)
        w.q_busy[q_slot] = True
        if n > 0:
            buf = kv % w.stages
            yield ("wait", w.k_full[buf], (kv // w.stages) & 1)
            yield from me.take_turn()
            me.read_q(q_slot, t)
            me.read_k(kv)
            me.give_turn()
            if defer and t > 0:
                _release(w, t, cid)
            w.k_empty[buf].arrive()
            yield from me.steady(kv, n, q_slot, t)
            cnt = kv + n - 1
            lbuf = cnt % w.stages
            yield ("wait", w.v_full[lbuf], (cnt // w.stages) & 1)
            yield from me.take_turn()
            me.read_v(cnt)
            me.give_turn()
            w.v_empty[lbuf].arrive()
        kv += n
        # O goes out through the Q buffer: it stays in use until its store is waited for.
        if not defer:
            w.q_busy[q_slot] = False
            w.q_empty[q_slot].arrive()
        yield ("step",)


def _release(w: World, t: int, cid: int) -> None:
    """_release_stored_q: the previous tile's O store waited for, its buffer handed back."""
    prev = ((t - 1) % w.q_bufs) * w.consumers + cid
    w.q_busy[prev] = False
    w.q_empty[prev].arrive()


def overlapped(w: World, cid: int) -> Step:
    """_consumer_overlapped."""
    me = Consumer(w, cid)
    kv = 0
    open_tile: tuple[int, int, int] | None = None  # (last K/V index, Q slot, tile)
    for t, n in enumerate(w.tiles):
        q_slot = (t % w.q_bufs) * w.consumers + cid
        yield ("wait", w.q_full[q_slot], (t // w.q_bufs) & 1)
        w.q_busy[q_slot] = True
        if n > 0:
            buf = kv % w.stages
            yield ("wait", w.k_full[buf], (kv // w.stages) & 1)
            if open_tile is not None:
                cnt_o, slot_o, t_o = open_tile
                obuf = cnt_o % w.stages
                yield ("wait", w.v_full[obuf], (cnt_o // w.stages) & 1)
                yield from me.take_turn()
                me.read_v(cnt_o)
                me.read_q(q_slot, t)
                me.read_k(kv)
                me.give_turn()
                w.v_empty[obuf].arrive()
                # The open tile's end: O through its buffer, the store waited for.
                w.q_busy[slot_o] = False
                w.q_empty[slot_o].arrive()
            else:
                # The kernel's PV runs here too, on whatever its buffers hold, and is
                # dropped (it waits for no barrier): no read to check.
                yield from me.take_turn()
                me.read_q(q_slot, t)
                me.read_k(kv)
                me.give_turn()
            w.k_empty[buf].arrive()
            yield from me.steady(kv, n, q_slot, t)
            open_tile = (kv + n - 1, q_slot, t)
        else:
            if open_tile is not None:
                yield from _close(me, open_tile)
            w.q_busy[q_slot] = False
            w.q_empty[q_slot].arrive()
            open_tile = None
        kv += n
        yield ("step",)
    if open_tile is not None:
        yield from _close(me, open_tile)


def _close(me: Consumer, open_tile: tuple[int, int, int]) -> Step:
    """_close_tile: the open tile's last PV alone, then its end."""
    w = me.w
    cnt_o, slot_o, _ = open_tile
    lbuf = cnt_o % w.stages
    yield ("wait", w.v_full[lbuf], (cnt_o // w.stages) & 1)
    yield from me.take_turn()
    me.read_v(cnt_o)
    me.give_turn()
    w.v_empty[lbuf].arrive()
    w.q_busy[slot_o] = False
    w.q_empty[slot_o].arrive()


def run(w: World, mode: str) -> str:
    """'' when every partition finishes, else what went wrong."""
    procs: list[Step] = [producer(w)]
    for cid in range(w.consumers):
        procs.append(overlapped(w, cid) if mode == "tile_overlap"
                     else serial(w, cid, defer=mode == "defer_o"))
    waiting: list[tuple[Any, ...] | None] = [None] * len(procs)
    alive = list(range(len(procs)))
    idle = 0
    while alive:
        w.step += 1
        w.land()
        ready = [i for i in alive if waiting[i] is None or waiting[i][1].passes(waiting[i][2])]
        if not ready:
            if not w.inflight:
                return "deadlock: " + "; ".join(
                    f"partition {i} waits {waiting[i][1].name} parity {waiting[i][2]} "
                    f"(done {waiting[i][1].done}, pending {waiting[i][1].pending})"
                    for i in alive)
            idle += 1
            if idle > 100:
                return "stalled"
            continue
        idle = 0
        i = w.rng.choice(ready)
        waiting[i] = None
        try:
            while True:
                op = next(procs[i])
                if op[0] == "wait" and not op[1].passes(op[2]):
                    waiting[i] = op
                    break
                if op[0] == "step" and w.rng.random() < 0.5:
                    break
        except StopIteration:
            alive.remove(i)
        except AssertionError as e:
            return f"violation in partition {i}: {e}"
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    counts = {m: 0 for m in ("serial", "defer_o", "tile_overlap")}
    for r in range(args.runs):
        tiles = [rng.choice([0, 1, 1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 9))]
        stages = rng.randint(2, 4)
        consumers = rng.choice([1, 2, 2, 3])
        pingpong = consumers == 2 and rng.random() < 0.5
        for mode in counts:
            if mode == "tile_overlap" and consumers == 3:
                continue
            w = World(tiles, stages, consumers, pingpong, 2, random.Random(rng.random()))
            why = run(w, mode)
            if why:
                print(f"run {r}, {mode}: tiles {tiles}, stages {stages}, consumers "
                      f"{consumers}, pingpong {pingpong}: {why}")
                sys.exit(1)
            counts[mode] += 1
    print(f"{args.runs} random programs, no deadlock or violation: "
          + ", ".join(f"{m} {n}" for m, n in counts.items()))


if __name__ == "__main__":
    main()
