"""Digest what `optimize` writes (the rewritten model and its JSON report, byte for byte) for the built-in models and
any exports given, at each precision: run it before a change that should keep every plan and again after.

    python tools/rewrite_digest.py -o before.json ~/.cache/onnx-gtco/zoo/*.onnx     (exports: tools/export_zoo.py)
    python tools/rewrite_digest.py --against before.json ~/.cache/onnx-gtco/zoo/*.onnx

With --against, prints one line per model and precision (same, or which file differs) and exits 1 on any
difference or on a model that failed on one side only. No library is built: the written files do not depend on it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from onnx_gtco import GtcoConfig
from onnx_gtco.errors import GtcoError
from onnx_gtco.models import BUILTIN, build
from onnx_gtco.pipeline import optimize_file

PRECISIONS = ("fp32", "fp16", "bf16")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digest(source: str, precision: str, target: str) -> dict[str, str]:
    """The sha256 of each file `optimize` writes for `source` (a built-in name or a path), or the error."""
    with tempfile.TemporaryDirectory(prefix="gtco-digest-") as tmp:
        out = Path(tmp) / "model.gtco.onnx"
        try:
            _, model, report = optimize_file(build(source) if source in BUILTIN else Path(source), out,
                                             config=GtcoConfig(precision=precision, target=target))
        except GtcoError as e:
            return {"error": f"{type(e).__name__}: {e}"}
        files = {"model": _sha(model), "report": _sha(report)}
        data = model.with_name(model.name + ".data")  # external weights, where the model is over 2 GB
        if data.exists():
            files["data"] = _sha(data)
        return files


def run(sources: Sequence[str], target: str, jobs: int) -> dict[str, dict[str, str]]:
    keys = [(s, p) for s in sources for p in PRECISIONS]
    args = ([s for s, _ in keys], [p for _, p in keys], [target] * len(keys))
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            done = list(pool.map(digest, *args))
    else:
        done = list(map(digest, *args))
    return {f"{Path(s).name if s not in BUILTIN else s} {p}": d for (s, p), d in zip(keys, done, strict=True)}


def compare(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> int:
    differ = 0
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        if b is None or a is None:
            print(f"{key}: only {'after' if b is None else 'before'}")
            differ += 1
        elif a == b:
            print(f"{key}: same{' (' + a['error'] + ', both)' if 'error' in a else ''}")
        else:
            which = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            print(f"{key}: DIFFERS in {', '.join(which)}")
            differ += 1
    print(f"{len(set(before) | set(after)) - differ} same, {differ} differ")
    return 1 if differ else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="exported .onnx files beside the built-in models")
    ap.add_argument("--builtin", action="append", choices=sorted(BUILTIN), metavar="NAME",
                    help="digest only these built-in models (repeatable; default: all of them)")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="models digested at a time (processes)")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("-o", "--output", type=Path, help="write the digests here (JSON)")
    what.add_argument("--against", type=Path, help="compare with digests written before")
    args = ap.parse_args(argv)
    missing = [m for m in args.models if not Path(m).is_file()]
    if missing:
        ap.error(f"no such model: {missing[0]}")
    now = run([*(args.builtin or BUILTIN), *args.models], args.target, args.jobs)
    if args.output is not None:
        args.output.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"{len(now)} digests ({sum('error' in d for d in now.values())} errors) written to {args.output}")
        return 0
    return compare(json.loads(args.against.read_text()), now)


if __name__ == "__main__":
    sys.exit(main())
