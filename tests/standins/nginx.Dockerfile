# Stand-in for nginx:1.28.2-alpine, the `scale` profile's triton-proxy (benchmarks/docker_env.py): Debian
# forky's nginx 1.30 (`server ... resolve` in upstreams needs 1.27.3+) with what the proxy uses of the
# official image: the `nginx` user, busybox wget (the healthcheck's; no curl), SIGQUIT as stop signal.
ARG BASE
FROM ${BASE}
RUN echo 'nginx:x:101:101:nginx:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
    && echo 'nginx:x:101:' >> /etc/group \
    && ln -s /bin/busybox /usr/local/bin/wget \
    && nginx -V 2>&1 | grep -q -- --with-http_v2_module
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
