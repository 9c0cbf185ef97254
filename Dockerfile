# glmflash: GLM-5.3-Flash behind an OpenAI API on port 3000.
#
#   docker build -t glmflash .
#   docker run --gpus all -p 3000:3000 glmflash          # no model set: the embedded tiny model
#   docker run --gpus all -p 3000:3000 -v /big/disk:/workspace \
#       -e GLMFLASH_MODEL=RedHatAI/GLM-5.3-Flash-NVFP4 -e GLMFLASH_MODEL_REVISION=<commit> glmflash
#
# Build arguments:
#   BASE_IMAGE       any image with apt (Ubuntu/Debian) or with python3 >= 3.10 + venv already in it.
#   TORCH_SPEC       pip requirement(s) for torch; empty = keep the torch a base image already has
#                    in /opt/venv (a "pre-installed" base). Split on spaces, so extra pip flags fit.
#   TORCH_INDEX_URL  index for TORCH_SPEC; empty = pip's default index (PyPI).
#   TRITON_SPEC      pip requirement for Triton, from PyPI, for a torch that brings none (a CPU build);
#                    empty = the one torch brings. Either way it is pinned for the steps after.
# Layers go from least to most often changed: system packages, torch, the project's dependencies
# (read from pyproject.toml alone), then the source.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# 1. System packages: Python with venv, CA certificates, and a C compiler for the CPU expert kernels.
#    Each is skipped when the base already has it, so a prepared base image builds without reaching a
#    Debian/Ubuntu mirror (without a compiler the kernels fall back to torch, and the build goes on).
RUN set -eux; \
    if python3 -c 'import sys, venv, ensurepip; assert sys.version_info >= (3, 10)' 2>/dev/null \
       && [ -s /etc/ssl/certs/ca-certificates.crt ]; then \
        echo "python3 $(python3 -V) and CA certificates already present"; \
    else \
        apt-get update; \
        apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    if ! command -v gcc >/dev/null 2>&1; then \
        if command -v apt-get >/dev/null 2>&1 && apt-get update \
           && apt-get install -y --no-install-recommends gcc libc6-dev; then \
            rm -rf /var/lib/apt/lists/*; \
        else \
            echo "no C compiler: the CPU expert kernels will run their torch path"; \
        fi; \
    fi; \
    [ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv; \
    mkdir -p /workspace

# 2. torch (the biggest layer; changes only with these arguments).
ARG TORCH_SPEC="torch==2.11.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TRITON_SPEC=""
RUN set -eux; \
    if [ -n "${TORCH_SPEC}" ]; then \
        if [ -n "${TORCH_INDEX_URL}" ]; then \
            pip install --index-url "${TORCH_INDEX_URL}" ${TORCH_SPEC}; \
        else \
            pip install ${TORCH_SPEC}; \
        fi; \
    fi; \
    if [ -n "${TRITON_SPEC}" ]; then pip install ${TRITON_SPEC}; fi; \
    python -c "import importlib.metadata as m, torch; print(f'torch=={torch.__version__}'); \
v = {d.metadata['Name']: d.version for d in m.distributions()}.get('triton'); print(f'triton=={v}' if v else '')" \
        > /opt/venv/torch-constraint.txt; \
    cat /opt/venv/torch-constraint.txt; \
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# 3. The project's dependencies and build backend, from pyproject.toml alone: editing the source
#    does not reinstall them. torch and Triton are pinned to the ones from step 2 (never replaced here;
#    without a pin a CPU torch's image would take the newest Triton pyproject.toml allows).
WORKDIR /opt/glmflash
COPY pyproject.toml ./
RUN set -eux; \
    python -c 'import tomllib; m = tomllib.load(open("pyproject.toml", "rb")); print("\n".join(m["build-system"]["requires"] + m["project"]["dependencies"]))' > /tmp/requirements.txt; \
    cat /tmp/requirements.txt; \
    pip install -c /opt/venv/torch-constraint.txt -r /tmp/requirements.txt wheel; \
    rm /tmp/requirements.txt

# 4. The source, installed without touching the network.
COPY README.md setup.py ./
COPY engine ./engine
COPY worker ./worker
COPY provision ./provision
COPY ops ./ops
RUN set -eux; \
    pip install --no-deps --no-build-isolation --no-index . ; \
    rm -rf build ./*.egg-info; \
    glmflash --help

# 5. The GPU kernels of the manifests the package ships (engine/kernels/manifests/), compiled now: a compile
#    targets an architecture, no GPU needed. A first start on a fresh volume copies them into its Triton
#    cache instead of compiling them (engine/kernels/prebuilt.py). Without Triton (a CPU-only torch) there is
#    nothing to compile and the build goes on.
RUN python -m engine.kernels.prebuilt /opt/glmflash/prebuilt-kernels \
    || echo "no prebuilt kernels: a first start compiles them"

ENV GLMFLASH_CACHE_DIR=/workspace/glmflash \
    GLMFLASH_PREBUILT_KERNELS=/opt/glmflash/prebuilt-kernels
WORKDIR /workspace
EXPOSE 3000

# /ready answers 200 only once the model is loaded and warmed up. The start period covers a cold
# download + load of a ~200-330 GB snapshot; a short interval reports "healthy" soon after ready.
HEALTHCHECK --interval=5s --timeout=4s --start-period=1800s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('GLMFLASH_PORT', '3000'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/ready', timeout=3).status == 200 else 1)"]

ENTRYPOINT ["glmflash", "boot"]
