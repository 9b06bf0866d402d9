"""Run the kernels on a real GPU: check them against fp64 references and time every implementation beside cuBLASLt,
torch and ONNX Runtime.

    python -m onnx_gtco.bench.kernel_bench [--arch sm_90] [--set vit-b16,bert-base,setr,detr] [--out DIR]
        [--reps 50] [--max-configs K] [--impls mma,cutlass,cublaslt] [--no-compile] [--compile-budget-s S]
        [--time-budget-s S] [--quick] [--compile-only] [--list]

Shape sets (`--set`, default all; `--list` prints them with their candidates, no GPU, no nvcc):

* vit-b16: ViT-B/16 at 224 px (197 tokens) at batch 1, 8 and 64: qkv, proj, fc1, fc2, the head; attention,
  BMM+softmax and residual+LayerNorm; the patch embedding conv.
* bert-base: BERT-base at batch 1 (the suite's) and 128 and 512 tokens: q/k/v, attention out, FFN, the pooler;
  masked attention and LayerNorm.
* setr: the suite's SETR-Naive, a ViT-B/16 encoder at 384 px (577 tokens), batch 1; its patch embedding and the
  head's 1x1 convs.
* detr: the suite's DETR-R50 at 320 px (100 encoder tokens, 100 queries), batch 1: every encoder and decoder
  GEMM and the heads, the encoder's GEMMs and attention at the paper's 800x1333 (1050 tokens) too, and the ResNet-50
  backbone's convolutions (BatchNorm folded into weights and bias) and the input projection.

Every GEMM is fp16 in and out with fp32 accumulation; identical GEMMs of a model are one row with its count. Each
GEMM row times, on the same inputs (CUDA events, median of `reps` runs after a warm-up; the same inputs every run,
so L2 holds what fits, for every candidate and baseline alike):

* every implementation's configurations: "mma" the generated kernels (the family's offered configs), "cutlass" the
  CUTLASS 3.x sm_90a instances (families.gemm.cutlass.configs; sm_90 target and a 9.0 GPU only), "cublaslt" cuBLASLt
  through our glue (its heuristic's ranks), each capped by --max-configs, each instance built as the tuner's GPU
  measurer builds a trial (tune.gpu.shared_library) and checked against the fp64 reference (‖err‖/‖ref‖; a wrong
  answer, a failed build or launch is marked and never "best");
* tuned: the fastest correct candidate of all implementations, the choice a GPU tuning study makes among these
  candidates (the tuner seeds its study with the analytical model's best of each implementation, a subset of
  them); beside it the analytical pick, the candidate the analytical model (tune.search.predict_us) ranks first,
  and its measured time;
* cuBLASLt fused: our cuBLASLt instance of the whole group at the heuristic's first rank (a GELU(erf) group, which
  cuBLASLt cannot express, is priced by the same group with the tanh GELU, marked "tanh proxy");
* separate epilogue: torch's cuBLAS(Lt) matmul then the epilogue as separate torch ops, both as `a @ b + bias` and
  as `addmm` (the bias in cuBLASLt's epilogue), the faster of the two;
* torch.compile(mode="max-autotune") of that unfused function (skipped by --no-compile; the compiles run last, in
  what is left of --compile-budget-s and --time-budget-s).

Each conv row times F.conv2d (cuDNN, NCHW, cudnn.benchmark) plus its epilogue in torch, a one-node Conv model
(+ Add + Relu as the model has them) on ONNX Runtime's CUDA EP (wall-clock per synchronous run with I/O bound to the
device, so it includes ORT's per-run overhead) when onnxruntime-gpu is importable, and our conv kernel family's
configurations (fp16, bias and the row's activation and residual fused), each checked against its fp64 reference.
Attention, BMM+softmax and LayerNorm rows time the
family's configurations beside torch SDPA / unfused torch, as before.

Writes results.json and results.md into --out after every row, with the ratios baseline / ours (> 1: ours faster):
tuned / separate epilogue, CUTLASS best / cuBLASLt fused, cuDNN (torch and ORT) / our conv.
Needs torch with CUDA and nvcc.
`--compile-only` builds every instance and launches nothing (no torch, no GPU: how `tools/gpu_suite --dry-run`
exercises this step). `--time-budget-s` stops starting rows at that time and lists the rest as skipped, so a call
that must end under a machine's command limit still writes whole files.

Its parts: `shapes` (the sets and their cases), `candidates` (what each case offers, and the builds), `measure`
(the GEMM, attention and LayerNorm rows and torch.compile), `conv` (the conv rows beside cuDNN and ORT), `markdown`.
"""
