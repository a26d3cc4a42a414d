# Stand-in for nvcr.io/nvidia/tritonserver:24.10-py3-sdk (the compose `bench` profile's perf service) on
# a host that no registry serves images to: perf_analyzer 2.51.0 from PyPI's tritonclient wheel, on PATH
# with python3 and numpy, over the tritonserver stand-in (whose pytriton wheel carries the CUDA runtime
# and libb64 that perf_analyzer links). Built by benchmarks/docker_env.py, for the compose tests only.
ARG BASE
FROM ${BASE}
# perf_analyzer comes with the plain tritonclient wheel (its extras' geventhttpclient has no Python 3.12
# wheel at 2.51's pin); it links libb64.so.0d and libcudart.so.12, which the pytriton wheel carries under
# other names.
RUN /opt/python/bin/pip install -q "tritonclient==2.51.0" \
    && libs=/opt/tritonserver/libs \
    && mkdir -p /opt/perf-libs \
    && ln -s "$(ls $libs/libb64-*.so.0d | head -n 1)" /opt/perf-libs/libb64.so.0d \
    && ln -s "$(ls $libs/libcudart-*.so.12* | head -n 1)" /opt/perf-libs/libcudart.so.12
ENV LD_LIBRARY_PATH=/opt/perf-libs:${LD_LIBRARY_PATH}
RUN ! ldd /opt/python/bin/perf_analyzer | grep "not found"
WORKDIR /workspace
