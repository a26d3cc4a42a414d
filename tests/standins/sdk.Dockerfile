# Stand-in for nvcr.io/nvidia/tritonserver:24.10-py3-sdk (the `bench` profile's perf; benchmarks/docker_env.py):
# perf_analyzer 2.51.0 from PyPI's tritonclient wheel, on PATH with python3 and numpy, over the
# tritonserver stand-in, whose pytriton wheel carries the libraries perf_analyzer links.
ARG BASE
FROM ${BASE}
# The plain tritonclient wheel (its extras' geventhttpclient has no Python 3.12 wheel at 2.51's pin); the
# pytriton wheel carries libb64.so.0d and libcudart.so.12 under other names.
RUN /opt/python/bin/pip install -q "tritonclient==2.51.0" \
    && libs=/opt/tritonserver/libs \
    && mkdir -p /opt/perf-libs \
    && ln -s "$(ls $libs/libb64-*.so.0d | head -n 1)" /opt/perf-libs/libb64.so.0d \
    && ln -s "$(ls $libs/libcudart-*.so.12* | head -n 1)" /opt/perf-libs/libcudart.so.12
ENV LD_LIBRARY_PATH=/opt/perf-libs:${LD_LIBRARY_PATH}
RUN ! ldd /opt/python/bin/perf_analyzer | grep "not found"
WORKDIR /workspace
