"""A model (not a measurement) of the deterministic Hopper backward's schedule: how much
of the GPU the fixed dQ order leaves idle, by batch-heads and GQA, with the grid launched
wave by wave as the hardware does, against a persistent grid that keeps whole heads
resident. CPU only; no kernel runs.

What it models (flashtune/kernels/attn_bwd_hopper.py, ORDER 2, non-causal):
- one program per (KV head, key tile of ``BLOCK_N`` keys); programs launch in grid order
  (key tile fastest) whenever an SM is free, one program per SM;
- a program walks its head group's query tiles, each query head in turn, starting at
  its own offset ``first = pid_n * n_m // n_n`` and wrapping around (``_query_tile``);
- each query tile costs the program one time unit of compute; its dQ add (the writer's
  TMA reduce-add) may run only when the programs ranked before it on that tile have
  added theirs (``_dq_turn``: the program whose walk started at or last before the tile
  first, then cyclically downwards), and takes ``add`` units;
- the consumer runs ahead of its writer by at most ``ring`` query tiles (the staging
  ring), so a late turn stalls the compute only when the ring is full.

    python3 benchmarks/experiments/dq_order_sim.py            # the table for S=4096
    python3 benchmarks/experiments/dq_order_sim.py --sms 132 --seqlen 4096 --add 0.1

Output: per case, the makespan over the ideal (total compute / SMs) and the share of
SM-time spent waiting. A model's numbers are hypotheses for a profile to confirm.
"""

from __future__ import annotations

import argparse
import heapq


def _rank(m: int, pid: int, n_m: int, n_n: int) -> int:
    lead = ((m + 1) * n_n + n_m - 1) // n_m - 1
    return (lead - pid + n_n) % n_n


def simulate(heads_kv: int, gqa: int, n_m: int, n_n: int, sms: int, add: float,
             ring: int, persistent: bool = False) -> tuple[float, float]:
    """(makespan / ideal, waiting share of SM-time) of one backward launch."""
    # Per (query head, query tile): the ranks' adds done so far and when the last one ended.
    done_rank: dict[tuple[int, int], tuple[int, float]] = {}
    total_tiles = heads_kv * n_n * gqa * n_m
    ideal = total_tiles / min(sms, heads_kv * n_n if persistent else sms)
    if persistent:  # whole heads only: as many as fit, the rest of the SMs idle
        sms = (sms // n_n) * n_n
    order = [(h, p) for h in range(heads_kv) for p in range(n_n)]
    events: list[tuple[float, int, int, int]] = []  # (time, seq, kind, program id)
    seq = 0
    state: dict[int, dict] = {}
    next_prog = 0
    wait_time = 0.0

    def walk(pid_n: int) -> list[tuple[int, int]]:
        first = pid_n * n_m // n_n
        return [(g, (first + it) % n_m) for g in range(gqa) for it in range(n_m)]

    def launch(sm: int, t: float) -> None:
        nonlocal next_prog, seq
        h, p = order[next_prog]
        pid = next_prog
        next_prog += 1
        state[pid] = dict(h=h, p=p, tiles=walk(p), computed=0, added=0, sm=sm,
                          compute_end=[], ready=t)
        schedule_compute(pid, t)

    def schedule_compute(pid: int, t: float) -> None:
        nonlocal seq
        st = state[pid]
        if st["computed"] >= len(st["tiles"]):
            return
        if st["computed"] - st["added"] >= ring:  # the ring is full: wait for the writer
            st["blocked_at"] = t
            return
        seq += 1
        heapq.heappush(events, (t + 1.0, seq, 0, pid))  # compute of the next tile ends

    def try_add(pid: int, t: float) -> None:
        nonlocal seq
        st = state[pid]
        if st["added"] >= st["computed"] or st.get("adding"):
            return
        g, m = st["tiles"][st["added"]]
        key = (st["h"] * gqa + g, m)
        r = _rank(m, st["p"], n_m, n_n)
        have, last = done_rank.get(key, (0, 0.0))
        if have < r:  # not its turn yet: try again when the previous rank adds
            st["waiting"] = (key, r)
            return
        start = max(t, last, st["compute_end"][st["added"]])
        st["adding"] = True
        seq += 1
        heapq.heappush(events, (start + add, seq, 1, pid))

    for sm in range(sms):
        if next_prog < len(order):
            launch(sm, 0.0)
    waiting_on: dict[tuple[tuple[int, int], int], int] = {}
    makespan = 0.0
    while events:
        t, _, kind, pid = heapq.heappop(events)
        st = state[pid]
        if kind == 0:  # a tile's compute ended
            st["computed"] += 1
            st["compute_end"].append(t)
            schedule_compute(pid, t)
            try_add(pid, t)
            if "waiting" in st:
                waiting_on[st["waiting"]] = pid
        else:  # a tile's dQ add ended
            st["adding"] = False
            g, m = st["tiles"][st["added"]]
            key = (st["h"] * gqa + g, m)
            have, _ = done_rank.get(key, (0, 0.0))
            done_rank[key] = (have + 1, t)
            st["added"] += 1
            st.pop("waiting", None)
            if "blocked_at" in st:
                wait_time += t - st.pop("blocked_at")
                schedule_compute(pid, t)
            try_add(pid, t)
            if "waiting" in st:
                waiting_on[st["waiting"]] = pid
            nxt = waiting_on.pop((key, have + 1), None)  # the next rank's turn
            if nxt is not None and nxt != pid:
                state[nxt].pop("waiting", None)
                try_add(nxt, t)
                if "waiting" in state[nxt]:
                    waiting_on[state[nxt]["waiting"]] = nxt
            if st["added"] == len(st["tiles"]):  # the program ends; its SM takes the next
                makespan = max(makespan, t)
                if next_prog < len(order):
                    launch(st["sm"], t)
    return makespan / ideal, wait_time / (makespan * sms) if makespan else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--add", type=float, default=0.1,
                    help="a dQ add's time in units of a tile's compute")
    ap.add_argument("--ring", type=int, default=2, help="staging ring depth in query tiles")
    args = ap.parse_args()
    n_m, n_n = args.seqlen // args.block_m, args.seqlen // args.block_n
    print(f"S={args.seqlen}: {n_n} key tiles per head, {n_m} query tiles; {args.sms} SMs; "
          f"dQ add {args.add} of a tile; ring {args.ring}")
    print("| case | programs | waves | launched in waves: time / ideal, waiting | "
          "persistent, whole heads: time / ideal |")
    print("|---|---|---|---|---|")
    for name, heads_kv, gqa in (("64 batch-heads", 64, 1), ("128 batch-heads", 128, 1),
                                ("128 query heads over 32 KV (GQA 4)", 32, 4)):
        progs = heads_kv * n_n
        wave, waited = simulate(heads_kv, gqa, n_m, n_n, args.sms, args.add, args.ring)
        pers, _ = simulate(heads_kv, gqa, n_m, n_n, args.sms, args.add, args.ring,
                           persistent=True)
        print(f"| {name} | {progs} | {progs / args.sms:.2f} | {wave:.3f}, {waited:.1%} | "
              f"{pers:.3f} |")


if __name__ == "__main__":
    main()
