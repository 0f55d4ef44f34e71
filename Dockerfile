# Switchyard's one image, for every process: web (the default), replicas, Celery worker and beat, the
# provisioner, migrations (scripts/image-entrypoint picks by its first argument). docs/deployment.md says
# how to build it (scripts/build-image builds it without a Docker engine) and run it.
#
# CPU by default. For GPUs, a CUDA base and PyTorch's matching index, e.g.
#   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Any Debian or Ubuntu base with Python 3.11 or 3.12 (or none: it is installed) will do.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
# The CPU build by default: a plain requirement on Linux pulls a multi-GB CUDA one (as in the Makefile).
# Empty: plain pip (PyPI, or PIP_FIND_LINKS).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Build time only, for pip, where the builder mounts them in (scripts/build-image's WHEELS_DIR and
# CA_BUNDLE): a folder of wheels, and the CA certificates of a TLS-inspecting proxy. No default: unset
# is not the same to pip as empty.
ARG PIP_FIND_LINKS
ARG PIP_CERT

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    HOME=/home/switchyard \
    SWITCHYARD_STATE_DIR=/var/lib/switchyard \
    PORT=8000

# gcc: the engine compiles its C kernels for the CPU it runs on at first use (serving/engine/native_library.py);
# without one it falls back to torch's operators. Python and venv only where the base lacks them (CUDA's).
RUN set -eux; \
    packages="gcc libc6-dev ca-certificates"; \
    python3 -c 'import ensurepip, venv' 2>/dev/null || packages="$packages python3 python3-venv"; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/venv

# A numeric user, so that Kubernetes' runAsNonRoot can check it; the code stays root's, read-only to it.
RUN set -eux; \
    groupadd --system --gid 10001 switchyard; \
    useradd --system --uid 10001 --gid 10001 --home-dir /home/switchyard --create-home \
        --shell /usr/sbin/nologin switchyard; \
    install -d -o 10001 -g 10001 -m 0750 /var/lib/switchyard

# torch first, on its own layer (the largest, and the one that changes least), then the other
# requirements from pyproject.toml: code changes rebuild neither. The project itself is not installed:
# it runs from /app (PYTHONPATH), as `python manage.py` and `celery -A config` expect.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
COPY pyproject.toml /app/pyproject.toml
RUN set -eux; \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('/app/pyproject.toml', 'rb'))['project']['dependencies']))" \
        >/tmp/requirements.txt; \
    pip install --no-cache-dir -r /tmp/requirements.txt; \
    rm /tmp/requirements.txt

COPY . /app
# Bytecode now: the app user cannot write __pycache__ under /app.
RUN chmod 0755 /app/scripts/image-entrypoint && python -m compileall -q /app

WORKDIR /app
USER 10001:10001
EXPOSE 8000
# Only the web process serves /healthz; in the image's other processes the check passes while they run.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/app/scripts/image-entrypoint", "healthcheck"]
ENTRYPOINT ["/app/scripts/image-entrypoint"]
CMD ["serve"]
