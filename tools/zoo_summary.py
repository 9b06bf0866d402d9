"""One line per model: nodes before/after, DP states, fused FLOP share, attention softmax fused, stage timings.

    python tools/zoo_summary.py ~/.cache/onnx-gtco/zoo/*.onnx     (exports: python tools/export_zoo.py)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from onnx_gtco import GtcoConfig, optimize
from onnx_gtco.errors import GtcoError

ATTENTION = ("attention", "bmm_softmax")


def summarize(path: Path, config: GtcoConfig) -> str:
    result = optimize(path, config)
    rep = result.report
    softmax = sum(n.op_type == "Softmax" for n in result.view.nodes)
    fused = sum(g["ops"].count("Softmax") for g in rep["groups"] if g["family"] in ATTENTION)
    t = result.timings
    return (f"{path.name:34s} {rep['nodes_before']:5d} -> {rep['nodes_after']:5d}  states {rep['dp_states']:6d}  "
            f"fused FLOPs {100 * rep['fused_flop_share']:6.2f}%  softmax in attention {fused}/{softmax}  "
            f"load {t['load_s']:.2f} s  plan {t['plan_s']:.2f} s  rewrite {t['rewrite_s']:.2f} s")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--target", default="sm_90")
    args = ap.parse_args(argv)
    config = GtcoConfig(target=args.target)
    failed = 0
    for path in args.models:
        try:
            print(summarize(path, config), flush=True)
        except GtcoError as e:
            failed += 1
            print(f"{path.name:34s} error: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
