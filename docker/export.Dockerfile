# The export image (`docker compose build export`, jobs in docker/export-entrypoint.sh): the project and
# pyproject.toml's `export` extra under the constraints, installed at build time. Context: the repository root.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}

# The `export` extra's torch pin (checked below) as the CPU wheel (PyPI's is the CUDA build), from PyTorch's
# CPU index or TORCH_FIND_LINKS, a folder inside the base image.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# Dependencies first (their layer survives code changes), then the project; /src is removed again.
WORKDIR /src
COPY pyproject.toml ./
COPY requirements/constraints.txt requirements/constraints.txt
RUN python -c "import tomllib; project = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(project['dependencies'] + project['optional-dependencies']['export']))" \
        > /tmp/requirements-export.txt \
    && if ! grep -qx "torch==${TORCH_VERSION}" /tmp/requirements-export.txt; then \
           echo "TORCH_VERSION=${TORCH_VERSION} is not the torch pin of pyproject.toml's export extra" >&2; exit 1; \
       fi \
    && if [ -n "${TORCH_FIND_LINKS}" ]; then torch_source="--no-index --find-links ${TORCH_FIND_LINKS}"; \
       else torch_source="--index-url ${TORCH_INDEX_URL}"; fi \
    && pip install --no-deps ${torch_source} "torch==${TORCH_VERSION}+cpu" \
    && pip install -c requirements/constraints.txt -r /tmp/requirements-export.txt \
    && pip check \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}' and not torch.version.cuda, torch.__version__"

COPY README.md ./
COPY client/ client/
COPY export/ export/
COPY server/ server/
COPY model_repository/ model_repository/
COPY vllm_plugin/ vllm_plugin/
RUN pip install --no-deps . \
    && cd / && rm -rf /src \
    && python -c "from mimi_code2wav.export.render import CODE2WAV_DIR; assert (CODE2WAV_DIR / '1' / 'model.py').is_file(), CODE2WAV_DIR"

WORKDIR /app
COPY docker/export-entrypoint.sh docker/export-entrypoint.sh
ENTRYPOINT ["sh", "/app/docker/export-entrypoint.sh"]
CMD ["export"]
