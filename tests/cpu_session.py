"""A model run by ONNX Runtime on the CPU, with a custom-op library registered where one is given: every op type it
has, CPU and (emulated) device kernels alike (`gtco.register all`); shared by the tests that compare a rewritten
model run through a library with its original."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from onnx_gtco.kernels.family import rel_error
from onnx_gtco.runtime.check import make_inputs


def cpu_session(model: onnx.ModelProto | Path, lib: Path | None = None, *, threads: int = 0,
                register: str = "all", profile: Path | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if lib is not None:
        so.add_session_config_entry("gtco.register", register)
        so.register_custom_ops_library(str(lib))
    if profile is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile / "profile")
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto | Path, x: dict[str, np.ndarray], lib: Path | None = None) -> list[np.ndarray]:
    return cpu_session(model, lib).run(None, x)


def assert_close_through_library(original: onnx.ModelProto, rewritten: onnx.ModelProto, lib: Path | None,
                                 tmp_path: Path, bound: float, label: str,
                                 sizes: Sequence[dict[str, int]] = ({},)) -> None:
    """The rewritten model run through `lib` (None: through its functions, no library) gives each output of the
    original within ‖err‖/‖ref‖ < bound, on one seeded input set per entry of `sizes` (the symbolic dims' sizes,
    default 1; one session for all), with the original's dtype and shape."""
    path = tmp_path / "model.gtco.onnx"
    onnx.save(rewritten, str(path))
    sess = cpu_session(path, lib)
    for dims in sizes:
        x = make_inputs(original, 1, dims)
        for out, ref, got in zip(original.graph.output, run(original, x), sess.run(None, x), strict=True):
            assert got.dtype == ref.dtype and got.shape == ref.shape, out.name
            err = rel_error(got.astype(np.float64), ref.astype(np.float64))
            print(f"{label} {out.name} {dims}: ‖err‖/‖ref‖ = {err:.3g}")
            assert err < bound, f"{label} {out.name} {dims}: ‖err‖/‖ref‖ = {err:.3g}"


def assert_close_through_built_libraries(original: onnx.ModelProto, rewritten: onnx.ModelProto, tmp_path: Path,
                                         bound: float, label: str, op_prefix: str | None = None,
                                         sizes: Sequence[dict[str, int]] = ({},)) -> None:
    """The rewritten model built as its CPU library and as its emulated device kernels (build_library, cuda=False),
    every node bound and, emulated, every kernel built (with `op_prefix`: an op type of that prefix among the
    device ones), each run giving the original's outputs within `bound` (assert_close_through_library)."""
    from onnx_gtco.plugin.library import build_library

    for emulated in (False, True):
        out = tmp_path / f"emu{int(emulated)}"
        out.mkdir()
        lib = build_library(rewritten, out, cuda=False, emulated=emulated)
        assert [(r.node, r.reason) for r in lib.nodes if r.reason] == []
        if emulated:
            assert lib.kernel_skips == {}, lib.kernel_skips
            assert op_prefix is None or any(t.startswith(op_prefix) for t in lib.cuda_op_types), lib.cuda_op_types
        assert_close_through_library(original, rewritten, lib.path, out, bound,
                                     f"{label} {'emulated kernels' if emulated else 'CPU library'}", sizes)
