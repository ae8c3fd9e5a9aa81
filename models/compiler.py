"""XLA options the model's programs compile with: the training step and evaluation (train.step) and the
prefill and decode programs (models.generate). GPU options; other platforms ignore them.
"""

# cuBLASLt on (XLA's default where jax does not turn it off): it is what takes a bias epilogue.
# Triton GEMM fusions off: XLA then rewrites each dot straight into cuBLASLt and fuses a vector
# bias into its epilogue (tests/test_gpu_projection.py; with them on, the biases stayed passes of
# their own). Dot merging off: merged, the k and v GEMMs (one input) made the backward concatenate
# dk with dv and add two dx. benchmarks.step times the step with and without them.
GEMM = {"xla_gpu_enable_cublaslt": True, "xla_gpu_enable_triton_gemm": False,
        "xla_gpu_dot_merger_threshold_mb": 0}

# A decode step is hundreds of short kernels, so launch gaps are part of its time. XLA's command
# buffers record a program's kernels into CUDA graphs; with WHILE and CONDITIONAL among the command
# types, the decode loop itself (lax.while_loop) becomes one graph with conditional nodes, launched
# once per call instead of kernel by kernel, and a minimum graph size of 1 lets every sequence of
# kernels join one. benchmarks.decode --xla-options compares these with XLA's defaults.
COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
                   "xla_gpu_graph_min_graph_size": 1}

# Decoding compiles with XLA's own options. Under COMMAND_BUFFERS the H200's jax 0.11.2 ran gpt2-small's decode
# loop one step more than asked (65 of 64: benchmarks.decode's step check) while the loop's condition launched no
# kernel (docs/walkthrough.md step 9); the condition now launches one, and the loop is recorded into CUDA graphs
# once a run on the GPU shows it exact (tests/test_gpu_decode.py). Under the training step's GEMM options
# (Triton GEMM fusions off) a decode step runs more kernels and takes longer at decode's batch sizes.
# benchmarks.decode --xla-options decode graphs gemm compares them.
DECODE = {}
