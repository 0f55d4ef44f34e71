# The README's two commands: `make serve` and `make test`. Both set up what they need first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
INSTALLED := $(VENV)/.installed

.PHONY: serve test install lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch first, pinned to the CPU build: a plain requirement in a fresh environment pulls a multi-GB CUDA one.
$(INSTALLED): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	touch $@

install: $(INSTALLED)

# The port (`make serve PORT=8080`) is checked first: seed_demo revokes the last demo key, which a server
# already running still serves.
PORT ?= 8000
serve: install
	@$(PY) -c "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', $(PORT)))" 2>/dev/null \
		|| { echo "port $(PORT) is in use (is make serve running already? another port: make serve PORT=8080); nothing was changed" >&2; exit 1; }
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py seed_demo
	$(PY) manage.py serve --host 127.0.0.1 --port $(PORT)

test: install
	bash scripts/run-tests

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf var .pytest_cache
