"""Fingerprints of the PTX every shipped backward (``--direction``: or forward) entry
compiles to, without a GPU.

For a change that should not touch generated code (a host-side launcher, say): run this on
the tree before and after, with Triton 3.6 (the GPU hosts' version) first on PYTHONPATH,
and compare the two outputs. Equal fingerprints for every entry mean the kernels the
entries were tuned on are the kernels that run, byte for byte (line info included), so
their timings still hold.

Each backward entry of ``flashtune/data/shipped.json`` (or ``--variant`` only) is built for
sm_90 through ``bwd_steps`` (the tuner's launch path) on CPU tensors of the entry's own
example shape, with the compile-only driver of ``benchmarks/probe_ptxas.py`` and 132 SMs
(H100 SXM and H200 alike); the output maps the entry's index to the sha256 of each
kernel's PTX: the code and its line info, without the debug sections and with the tree's
path as ``<tree>`` (``code``), so that two trees at two paths compare. Each run builds into
a Triton cache of its own: with one shared cache, the second tree's builds were the first
one's, loaded (the cache key holds no path), and proved only that the keys agree.

    PYTHONPATH=<triton 3.6>:<tree>:<tree>/benchmarks python3 \\
        benchmarks/experiments/bwd_ptx_identity.py --out ptx.json [--variant 3]

``--sass`` fingerprints each kernel's machine code instead: the SASS that Triton's own
``cuobjdump`` prints from the cubin it built, which carries no line info. Equal SASS was the
proof for an edit that moves lines in a kernel module (each kernel's PTX then differs in
its ``.loc`` directives only, and those do not reach the machine code) or that changes
code the entries do not compile (a ``constexpr`` branch they do not take). ``--no-lines``
proves the same from the PTX without its line info (nor the labels that anchor its debug
scopes), and is the better proof: the ptxas
of Triton 3.6 (12.8) does not always give the same machine code for the same PTX: on the
Hopper backward's large D=128 kernels three builds of one PTX gave three schedules
(session 38). A SASS difference between fresh builds there is no proof of a change.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import re
import shutil
import tempfile

# A Triton cache of this run's own (unless TRITON_CACHE_DIR names one), so that each tree's
# code is built, not loaded: the two trees' builds share cache keys (the source path is not
# in them), and a shared cache answers for the second tree with the first one's build.
if "TRITON_CACHE_DIR" not in os.environ:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ptx-identity-")
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], True)

import torch  # noqa: E402
from probe_ptxas import BUILT_CUBIN, BUILT_PTX, _install_compile_only  # noqa: E402

_install_compile_only()

import flashtune.kernels.attn_bwd_hopper as H  # noqa: E402
import flashtune.kernels.attn_fwd_hopper as FH  # noqa: E402
from flashtune.kernels.attn_bwd import bwd_steps  # noqa: E402
from flashtune.kernels.attn_fwd import attn_fwd  # noqa: E402
from flashtune.kernels.config import config_from_dict  # noqa: E402
from flashtune.problem import default_scale  # noqa: E402

# The tree's own path appears in the PTX (its .file directives, and byte by byte in the
# DWARF sections after the code): code() reads the PTX without both.
TREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(FH.__file__))))


DEBUG_LABEL = re.compile(r"^\$L__tmp\d+:\s*$")


def code(ptx: str, lines: bool = True) -> str:
    """``ptx`` up to its debug sections, the tree's path as ``<tree>``: all of the code
    and, with ``lines``, its line info (``.loc``, ``.file``), none of where the tree
    lies."""
    out = ptx.split("\n\t.section\t.debug", 1)[0].replace(TREE, "<tree>")
    if not lines:
        # Without line info also without the labels that only anchor the debug sections'
        # scopes (``$L__tmpN:``, one per inlined call's start or end; no instruction
        # refers to them): a helper function more, inlined, numbers them anew.
        out = "\n".join(ln for ln in out.split("\n")
                        if not ln.lstrip().startswith((".loc", ".file"))
                        and not DEBUG_LABEL.match(ln))
    return out

H._sm_count = lambda index: 132
FH._sm_count = lambda index: 132
FH._l2_bytes = lambda index: 50 << 20  # any one size: both trees are built alike


def sass(cubin: bytes) -> str:
    """The SASS of ``cubin`` as the cuobjdump shipped with Triton prints it."""
    import subprocess
    import tempfile

    import triton
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                       "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([exe, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout.replace(f.name, "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", type=int, default=None)
    ap.add_argument("--shipped", default=os.path.join("flashtune", "data", "shipped.json"))
    ap.add_argument("--sass", action="store_true",
                    help="fingerprint the SASS of each kernel's cubin, not its PTX")
    ap.add_argument("--no-lines", action="store_true",
                    help="leave the PTX's line info (.loc, .file) out of its fingerprint: "
                         "for an edit that moves lines in a kernel module")
    ap.add_argument("--direction", choices=("bwd", "fwd", "both"), default="bwd",
                    help="the entries to build (fwd: through attn_fwd)")
    args = ap.parse_args()
    with open(args.shipped) as f:
        entries = json.load(f)["entries"]
    out: dict[str, dict[str, str]] = {}
    for i, e in enumerate(entries):
        if args.direction not in ("both", e["direction"]):
            continue
        cfg = config_from_dict(e["direction"], e["config"])
        if args.variant is not None and cfg.variant != args.variant:
            continue
        x = e["example"]
        b, hq, hk, sq, sk, d = (x["batch"], x["heads_q"], x["heads_kv"], x["seqlen_q"],
                                x["seqlen_k"], x["head_dim"])
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[x["dtype"]]
        q, do, o = (torch.empty(b, hq, sq, d, dtype=dt) for _ in range(3))
        k, v = (torch.empty(b, hk, sk, d, dtype=dt) for _ in range(2))
        lse = torch.empty(b, hq, sq)
        det = e["problem"].get("deterministic", True)
        BUILT_PTX.clear()
        BUILT_CUBIN.clear()
        kw = dict(causal=x["causal"], sm_scale=default_scale(d), window=tuple(x["window"]),
                  softcap=x["softcap"], config=cfg)
        if e["direction"] == "fwd":
            attn_fwd(q, k, v, **kw)
        else:
            _, steps = bwd_steps(do, q, k, v, o, lse, deterministic=det, **kw)
            for _, step in steps:
                step()
        if args.sass:
            out[str(i)] = {name: hashlib.sha256(sass(cubin).encode()).hexdigest()
                           for name, cubin in sorted(BUILT_CUBIN.items())}
        else:
            out[str(i)] = {name: hashlib.sha256(code(ptx, not args.no_lines).encode()).hexdigest()
                           for name, ptx in sorted(BUILT_PTX.items())}
        print(i, e["direction"], e["device"]["name"], cfg.variant, f"{b}x{hq}/{hk}x{sq}x{d}",
              "causal" if x["causal"] else "", sorted(BUILT_PTX), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
