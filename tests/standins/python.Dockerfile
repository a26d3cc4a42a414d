# Stand-in for python:3.11-slim-bookworm, the export image's base (benchmarks/docker_env.py): Debian's
# Python 3.11 in a virtual environment first on PATH, as the official image's /usr/local/bin, and the CPU
# torch wheel in /opt/wheels (the export build takes it with TORCH_FIND_LINKS=/opt/wheels).
ARG BASE
FROM ${BASE}
RUN python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY wheels/ /opt/wheels/
