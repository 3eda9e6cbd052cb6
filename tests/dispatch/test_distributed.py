"""Two processes under torch.distributed (gloo, CPU) pick the same config for every
problem: rank 0's table wins over rank 1's own database, and with online tuning on,
rank 0 tunes and rank 1 uses its result."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dispatch.test_dispatch import BWD_A, FWD_A, FWD_B, prob, put

WORLD = 2


def _problems(tuning: bool):
    if tuning:  # one tuned problem and one miss that rank 0 tunes
        return [prob(), prob(seqlen_q=32, seqlen_k=32)]
    return [
        prob(),  # tuned differently in each rank's database: rank 0's must win
        prob(seqlen_q=32, seqlen_k=32),  # nearest (to the tuned 64 bucket)
        prob(head_dim=64, causal=False),  # default
        prob(seqlen_q=16, seqlen_k=48, heads_kv=4),  # another key, Sq != Sk
    ]


def _worker(rank: int, init: str, dbs: list[str], out: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ["FLASHTUNE_DB"] = dbs[rank]
    import flashtune
    from flashtune import dispatch
    from flashtune.kernels.config import config_to_dict

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        picked = []
        tuning = os.environ.get("FLASHTUNE_TUNE_ON_MISS") == "1"
        for p in _problems(tuning):
            dt = torch.bfloat16
            q = torch.randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim, dtype=dt,
                            requires_grad=p.head_dim == 32)
            k = torch.randn(p.batch, p.heads_kv, p.seqlen_k, p.head_dim, dtype=dt,
                            requires_grad=p.head_dim == 32)
            v = torch.randn_like(k)
            o = flashtune.flash_attention(q, k, v, causal=p.causal)
            if o.requires_grad and not tuning:
                o.float().sum().backward()
            fwd = dispatch.resolve("fwd", q, k, p.causal, (-1, -1), 0.0)
            row = {"fwd": config_to_dict(fwd)}
            if not tuning:
                row["bwd"] = config_to_dict(dispatch.resolve("bwd", q, k, p.causal, (-1, -1),
                                                             0.0))
            picked.append(row)
        Path(out, f"{rank}.json").write_text(json.dumps({"picked": picked,
                                                         "stats": dispatch.stats()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, env: dict[str, str]) -> list[dict]:
    dbs = [str(tmp_path / f"rank{r}.db") for r in range(WORLD)]
    # Each rank has its own database, tuned differently for the same problem.
    put(dbs[0], prob(), "fwd", FWD_A)
    put(dbs[0], prob(), "bwd", BWD_A)
    put(dbs[1], prob(), "fwd", FWD_B)
    env = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "0"), **env}
    mp.spawn(_worker, args=(f"file://{tmp_path / 'init'}", dbs, str(tmp_path), env),
             nprocs=WORLD, join=True)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]


def test_ranks_pick_rank0s_configs(tmp_path):
    got = _spawn(tmp_path, {})
    assert got[0]["picked"] == got[1]["picked"]
    assert got[0]["picked"][0]["fwd"]["block_m"] == FWD_A.block_m  # rank 0's entry


def test_online_tuning_rank0_tunes_and_shares(tmp_path):
    pytest.importorskip("optuna")
    got = _spawn(tmp_path, {"FLASHTUNE_TUNE_ON_MISS": "1", "FLASHTUNE_TUNE_TRIALS": "2"})
    assert got[0]["picked"] == got[1]["picked"]
    assert got[0]["stats"]["tunes"] == 1 and got[1]["stats"]["tunes"] == 0


class _Store:
    """The two calls of a c10d store that the exchange uses."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, name: str, value: bytes) -> None:
        self.data[name] = value

    def wait(self, names: list[str], timeout: object) -> None:
        assert all(n in self.data for n in names)

    def get(self, name: str) -> bytes:
        return self.data[name]


def test_tables_cross_ranks_as_json_and_a_pickle_is_never_loaded(tmp_path: Path) -> None:
    import pickle

    from flashtune.dispatch._distributed import (
        Dist,
        decode_results,
        encode_results,
        exchange,
    )
    from tests.db import _data

    pairs = [(r, "user") for r in _data.results(3, 4)]
    store = _Store()
    exchange(Dist(0, store, 1.0), "k", lambda: pairs, encode_results, decode_results)
    json.loads(store.data["k"])  # plain JSON on the wire
    got = exchange(Dist(1, store, 1.0), "k", lambda: None, encode_results, decode_results)
    assert [(r.key, r.config, r.median_ms, layer) for r, layer in got] == \
        [(r.key, r.config, r.median_ms, layer) for r, layer in pairs]

    flag = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (flag.write_text, ("code ran",))

    store.data["k"] = pickle.dumps(Evil())
    with pytest.raises(ValueError):
        exchange(Dist(1, store, 1.0), "k", lambda: None, encode_results, decode_results)
    assert not flag.exists()
    store.data["k"] = json.dumps([{"entry": {"median_ms": 0}, "layer": "user"}]).encode()
    with pytest.raises(ValueError, match="invalid entry"):
        exchange(Dist(1, store, 1.0), "k", lambda: None, encode_results, decode_results)
