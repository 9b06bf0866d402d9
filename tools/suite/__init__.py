"""The parts of tools/gpu_suite, one concern a module:

- common: the Step record, running a command with a timeout into its log, atomic writes;
- machine: what the machine is (GPU, CUDA, versions, the checkout's commit), the GPU bundle's environment, and the
  install of carried wheels;
- preflight: every package, header and tool the run needs, resolved before anything compiles;
- plan: the models and the ordered plan of rows (smoke, calibration, core, kernels, tune, rest, extra), with each row's
  expected time on an H200;
- rows: how each kind of row runs (smoke, calibration, export/optimize/bench, kernel bench);
- calibration: the calibration row's provenance, the records its refit fits, its summary and Markdown section;
- runner: the budget, the order, resuming a cut-off run, the summary written after every row;
- render: OUT/benchmarks.md and the short table printed last.
"""
