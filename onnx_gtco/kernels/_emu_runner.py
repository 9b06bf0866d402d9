"""Child process of onnx_gtco.kernels.emulate: load an emulated library, fill the C struct, call the entry point.

Usage: python -m onnx_gtco.kernels._emu_runner LIB SYMBOL FIELDS NPZ OUT1,OUT2 [CALLS]
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

from onnx_gtco.kernels.family import Field, c_args, entry_point


def main(argv: list[str]) -> int:
    lib_path, symbol, spec_path, npz_path, outputs, *rest = argv
    calls = int(rest[0]) if rest else 1
    with np.load(npz_path) as data:
        arrays = {k: np.ascontiguousarray(data[k]) for k in data.files}
    names = [k for k in outputs.split(",") if k]
    initial = {k: arrays[k].copy() for k in names}
    fields = [Field(*line.split("\t")) for line in Path(spec_path).read_text().splitlines() if line]
    args = c_args(fields, lambda name: arrays[name].ctypes.data)
    fn = entry_point(lib_path, symbol, args)
    for i in range(calls):
        if i:
            for k in names:
                np.copyto(arrays[k], initial[k])  # in place: args hold these buffers' addresses
        code = fn(ctypes.byref(args), None)
        if code != 0:
            print(f"{symbol} returned error code {code}", file=sys.stderr)
            return 4
    np.savez(Path(npz_path).with_name("out.npz"), **{k: arrays[k] for k in names})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
