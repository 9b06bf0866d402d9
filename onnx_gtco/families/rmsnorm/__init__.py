"""The rmsnorm kernel family (onnx_gtco.families: what each module holds)."""
