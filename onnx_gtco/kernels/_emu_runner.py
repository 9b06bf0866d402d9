"""Child process of onnx_gtco.kernels.emulate: load an emulated library, fill the C struct, call the entry point.

Usage: python -m onnx_gtco.kernels._emu_runner LIB SYMBOL FIELDS NPZ OUT1,OUT2
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}


def main(argv: list[str]) -> int:
    lib_path, symbol, spec_path, npz_path, outputs = argv
    with np.load(npz_path) as data:
        arrays = {k: np.ascontiguousarray(data[k]) for k in data.files}
    rows = [line.split("\t") for line in Path(spec_path).read_text().splitlines() if line]
    struct = type("Args", (ctypes.Structure,), {"_fields_": [(name, _CTYPES[kind]) for name, kind, _ in rows]})
    args = struct()
    for name, kind, value in rows:
        if kind == "ptr":
            setattr(args, name, arrays[value].ctypes.data if value else None)
        elif kind == "f32":
            setattr(args, name, float(value))
        else:
            setattr(args, name, int(value))
    fn = getattr(ctypes.CDLL(lib_path), symbol)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(struct), ctypes.c_void_p]
    code = fn(ctypes.byref(args), None)
    if code != 0:
        print(f"{symbol} returned error code {code}", file=sys.stderr)
        return 4
    np.savez(Path(npz_path).with_name("out.npz"), **{k: arrays[k] for k in outputs.split(",") if k})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
