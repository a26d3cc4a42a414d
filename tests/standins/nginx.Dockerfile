# Stand-in for nginx:1.28.2-alpine (the compose `scale` profile's triton-proxy) on a host that no
# registry serves images to: Debian forky's nginx (1.30, which has `server ... resolve` in upstreams,
# 1.27.3 and later) with what the official image carries that the proxy uses: the `nginx` user, busybox
# wget (the healthcheck's tool; the official image keeps no curl), SIGQUIT as the stop signal.
# Built by benchmarks/docker_env.py, for the compose tests only.
ARG BASE
FROM ${BASE}
RUN echo 'nginx:x:101:101:nginx:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
    && echo 'nginx:x:101:' >> /etc/group \
    && ln -s /bin/busybox /usr/local/bin/wget \
    && nginx -V 2>&1 | grep -q -- --with-http_v2_module
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
