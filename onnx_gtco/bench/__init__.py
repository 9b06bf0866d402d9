"""`onnx-gtco bench`: time a model's baselines (ORT fp32/fp16, ORT's transformer optimizer, torch.compile,
TensorRT) and ours on the same seeded inputs, with each one's accuracy and the model's roofline floor."""

from onnx_gtco.bench.output import format_table, write_outputs
from onnx_gtco.bench.run import BenchOptions, run_bench
from onnx_gtco.bench.variants import BASELINES, OURS

__all__ = ["BASELINES", "OURS", "BenchOptions", "format_table", "run_bench", "write_outputs"]
