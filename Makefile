# Two commands on a fresh clone: `make demo` (the main job) and `make test` (everything CI runs).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean peers browser pd prometheus systemd

$(STAMP): pyproject.toml constraints.txt $(wildcard src/kvfence/model/csrc/*.cpp)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# constraints.txt pins the CPU torch 2.13.0 that lies on disk (never the CUDA build).
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,pd]'
	# The C++ kernels (paged decode, small linear; g++; seconds), built here so no engine start
	# pays for it; a pip install builds them on first use instead (kvfence/model/kernel_build.py).
	@command -v g++ >/dev/null || { sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q g++; }
	$(BIN)/python -m kvfence.model.paged_cpu build
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvfence

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy

# The whole suite, peers and browser included: installed here (cached), so none of it skips.
# --durations: the 30 slowest steps close the log, so a run over budget shows where it went.
test: lint peers browser pd prometheus systemd
	KVFENCE_REQUIRE_PEERS=1 KVFENCE_REQUIRE_BROWSER=1 KVFENCE_REQUIRE_PROMETHEUS=1 KVFENCE_REQUIRE_SYSTEMD=1 \
	  $(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)

# The real peer engines (vLLM CPU, llama-server) for tests/peers, cached outside the clone
# in $KVFENCE_PEER_CACHE (default /var/cache/kvfence-peers): ~20 min cold, seconds warm.
peers:
	bash bench/peers/install.sh

# Debian's chromium for the HTML report's render test (tests/audit/test_report_render.py);
# nothing to do when /usr/bin/chromium exists. apt-get needs root (sudo when not root).
browser:
	@if [ -x /usr/bin/chromium ]; then /usr/bin/chromium --version; else \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q chromium; \
	fi

# The real PD stack's native parts (tests/transfer, tests/pd): Mooncake's engine links
# libibverbs even for TCP (Debian libibverbs1); NIXL's wheel declares a CUDA torch it does
# not need (its core, UCX and POSIX plugins link no CUDA), so it goes in with --no-deps.
NIXL := nixl-cu12==1.5.1
pd: $(STAMP)
	@if ldconfig -p | grep -q 'libibverbs.so.1 '; then echo "libibverbs1 present"; else \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q libibverbs1; \
	fi
	@$(BIN)/pip show -q nixl-cu12 2>/dev/null || $(BIN)/pip install -q --no-deps '$(NIXL)'

# Debian's Prometheus (2.42, with promtool) for tests/watch/test_watch_prometheus.py: the
# shipped alert rules in deploy/ are checked and fired against the real server on loopback.
prometheus:
	@if [ -x /usr/bin/prometheus ] && [ -x /usr/bin/promtool ]; then /usr/bin/prometheus --version 2>&1 | head -1; else \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends prometheus; \
	fi
	/usr/bin/promtool check rules deploy/prometheus/kvfence-rules.yml

# Debian's systemd for `systemd-analyze verify` of deploy/systemd (tests/deploy/test_systemd_unit.py).
systemd:
	@if command -v systemd-analyze >/dev/null; then systemd-analyze --version | head -1; else \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q --no-install-recommends systemd; \
	fi

clean:
	rm -rf $(VENV)
