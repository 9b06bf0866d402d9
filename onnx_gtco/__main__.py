"""python -m onnx_gtco -> the CLI."""

from onnx_gtco.cli import main

raise SystemExit(main())
