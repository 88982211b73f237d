#!/usr/bin/env bash
# The GPU suite (issue 8), for a machine with NVIDIA GPUs: installs the
# project with its test and gpu extras (CuPy, NCCL), prints `shardax
# report`, runs the GPU tests, the conformance suite over NCCL where there
# are several GPUs, then the CUDA AdamW benchmark. On a CPU host the tests
# skip.
#
#   bash tests/gpu/run.sh                 # from the repository root
set -euo pipefail
# (a machine without a package index keeps what is installed: the tests say
# what they skip, and why)
python -m pip install -q -e ".[test,gpu]" || echo "run.sh: could not install .[test,gpu]"
shardax report
python -m pytest -q -rs tests/gpu tests/collectives/test_cupy.py tests/test_cuda_kernels.py "$@"
# the conformance suite over NCCL (CuPy's communicators), one rank per GPU
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -gt 1 ]; then
  SHARDAX_BACKEND=cupy shardax launch --nproc-per-node "$gpus" -m shardax.collectives.conformance
fi
# the fused AdamW kernel on 100M elements against torch's and a plain copy
python benchmarks/optim.py --device cuda --numel 100000000 --reps 20 --json gpu-optim.json
