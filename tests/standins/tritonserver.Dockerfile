# Stand-in for nvcr.io/nvidia/tritonserver (built by benchmarks/docker_env.py, as no registry serves images
# here): the pip tritonserver 2.51.0 (PyPI's nvidia-pytriton 0.7.0) laid out as NGC lays it out, with
# tritonserver on PATH, the Python backend and its stub, Triton's ONNX Runtime backend (CPU) with ONNX
# Runtime 1.19.2, /opt/nvidia/nvidia_entrypoint.sh, curl, and python3 with numpy<2 and libpython. Its
# Python models run on cpython/ of the context (the host's CPython 3.12, as on NGC 25.x and later), or on
# Debian's 3.11 where that is empty. No CUDA, TensorRT or GPU metrics.
ARG BASE
FROM ${BASE}

RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends curl libpython3.11 >/dev/null \
    && rm -rf /var/lib/apt/lists/*

COPY cpython/ /opt/cpython/
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    LD_LIBRARY_PATH=/opt/cpython/lib:/usr/lib/x86_64-linux-gnu:/opt/tritonserver/libs
RUN set -e; \
    if [ -x /opt/cpython/bin/python3 ]; then python=/opt/cpython/bin/python3; else python=python3; fi; \
    "$python" -m venv /opt/python; \
    /opt/python/bin/pip install -q nvidia-pytriton==0.7.0 numpy==1.26.4

RUN set -e; \
    version=$(/opt/python/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
    wheel=/opt/python/lib/python$version/site-packages/pytriton/tritonserver; \
    mkdir -p /opt/tritonserver/bin /opt/tritonserver/backends/python; \
    ln -s "$wheel/bin/tritonserver" /opt/tritonserver/bin/tritonserver; \
    ln -s "/opt/python/lib/python$version/site-packages/nvidia_pytriton.libs" /opt/tritonserver/libs; \
    cp "$wheel/backends/python/libtriton_python.so" "$wheel/backends/python/triton_python_backend_utils.py" \
        "$wheel/python_backend_stubs/$version/triton_python_backend_stub" /opt/tritonserver/backends/python/
COPY onnxruntime/ /opt/tritonserver/backends/onnxruntime/
COPY nvidia_entrypoint.sh /opt/nvidia/nvidia_entrypoint.sh

# The stub embeds Python and finds its environment through python3 on PATH.
ENV PATH=/opt/python/bin:/opt/tritonserver/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /opt/tritonserver
# The server and its libraries load (--help exits 1 after printing the options), and so would the stub.
RUN tritonserver --help 2>&1 | grep -q -- "--model-repository" \
    && ! ldd /opt/tritonserver/backends/python/triton_python_backend_stub | grep "not found"
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]
