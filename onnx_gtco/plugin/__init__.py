"""The ONNX Runtime custom-op library of an optimized model: bind fused nodes, generate the glue, build, load."""
