# Sourced by the ops/gpu_*.sh scripts (from the repository root): wheels a CUDA machine without network lacks
# are installed from .whl/ into /tmp/site (each package's build for the machine's Python, where .whl holds builds
# for several); the repository and that folder go on PYTHONPATH; Python prints as it goes. A machine with torch and triton but nothing else of ours needs fla-core, transformers, llguidance,
# pydantic, pydantic-core, pydantic-settings, annotated-types, typing-inspection, python-dotenv, jsonschema,
# jsonschema-specifications, referencing, rpds-py, cryptography, cffi and pycparser; the soak's client (ops/soak.py)
# openai with anyio, h11, httpcore2, httpx2, idna, jiter, sniffio and truststore. Where the machine's
# huggingface-hub is 1.x, carry transformers 5.24 (5.25 asks for huggingface-hub >= 2.4 at import).
if compgen -G ".whl/*.whl" >/dev/null; then
  # By name, so pip takes each package's wheel for this machine's Python where .whl holds several.
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $(ls .whl | sed -E 's/-[0-9].*//; s/_/-/g' | sort -u)
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
