"""onnx-gtco: fuse transformer subgraphs of an ONNX model into Tensor Core kernels for ONNX Runtime."""

from onnx_gtco.config import GtcoConfig, Target
from onnx_gtco.errors import GtcoError
from onnx_gtco.pipeline import OptimizeResult, __version__, optimize, optimize_file
from onnx_gtco.runtime.session import make_session

__all__ = ["GtcoConfig", "GtcoError", "OptimizeResult", "Target", "__version__", "make_session", "optimize",
           "optimize_file"]
