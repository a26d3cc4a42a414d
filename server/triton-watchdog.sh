#!/bin/sh
# The entrypoint of every server (serve, compose, Kubernetes; docs/design.md §5.2, §5.3):
#   triton-watchdog.sh tritonserver --model-repository=/models ...
# runs the command with the access folder's flags, passes SIGTERM and SIGINT on (the server drains) and exits
# with its code; SIGKILLs a hung server or one with a dead Python stub and exits 137, for the restart policy.
# Hung: WATCHDOG_CHECKS (3; 0: off) /v2/health/live checks in a row, one every WATCHDOG_INTERVAL_S (1), unanswered
# within WATCHDOG_TIMEOUT_S (2); a refused connection (loading) or any answer resets the count. Dead stub: unless
# it aborts, Triton 2.51 answers ready while requests fail "Stub process '...' is not healthy"; every WATCHDOG_PROBE_S
# (5; 0: off) code2wav, then the decoder, get a START+END call within WATCHDOG_PROBE_TIMEOUT_S (10), at WATCHDOG_HTTP.
# WATCHDOG_ACCESS_DIR (/run/code2wav-access; empty: none; docker/access/README.md): server.pem + server.key TLS,
# client-ca.pem mutual TLS, inference.key and admin.key (else admin calls take the inference key). Triton takes
# keys only on its command line; the probe gives curl the key on stdin. Needs sh, curl, sed, date and sleep.

set -u

http=${WATCHDOG_HTTP:-http://127.0.0.1:8000}
url=$http/v2/health/live
interval=${WATCHDOG_INTERVAL_S:-1}
timeout=${WATCHDOG_TIMEOUT_S:-2}
checks=${WATCHDOG_CHECKS:-3}
probe_s=${WATCHDOG_PROBE_S:-5}
probe_timeout=${WATCHDOG_PROBE_TIMEOUT_S:-10}
# code2wav's START+END without frames (it answers without the decoder), the decoder's of one silent step.
PROBE_SEQUENCE='"parameters":{"sequence_id":18446744073709551615,"sequence_start":true,"sequence_end":true}'
CODE2WAV_PROBE="{$PROBE_SEQUENCE,\"inputs\":[{\"name\":\"input_ids\",\"shape\":[1,0],\"datatype\":\"INT64\",\"data\":[]}]}"
DECODER_PROBE="{$PROBE_SEQUENCE,\"inputs\":[{\"name\":\"codes\",\"shape\":[1,8,1],\"datatype\":\"INT32\",\"data\":[0,0,0,0,0,0,0,0]}]}"
access_dir=${WATCHDOG_ACCESS_DIR-/run/code2wav-access}
INFERENCE_PROTOCOLS=inference,metadata,model-config
ADMIN_PROTOCOLS=model-repository,shared-memory,statistics,trace,logging

die() { echo "triton-watchdog: $*" >&2; exit 2; }

[ $# -gt 0 ] || die "usage: triton-watchdog.sh COMMAND [ARGS...]  (the tritonserver command line to watch)"
case $checks in '' | *[!0-9]*) die "WATCHDOG_CHECKS must be a whole number, got '$checks'" ;; esac
case $probe_s in '' | *[!0-9]*) die "WATCHDOG_PROBE_S must be a whole number of seconds, got '$probe_s'" ;; esac

[ -n "$access_dir" ] || access_dir=/nonexistent/code2wav-access
has() { [ -f "$access_dir/$1" ]; }

# The one word of key file $1 (trimmed; nothing without the file); exits naming the file if it holds more.
read_key() {
    has "$1" || return 0
    key=$(sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' "$access_dir/$1") || exit 2
    case $key in
        '' | *[[:space:],:=]*) die "$access_dir/$1 must hold one key: not empty, without whitespace, ',', ':' or '='" ;;
    esac
    printf '%s' "$key"
}

access="plaintext gRPC"
has client-ca.pem && ! has server.pem && die "mutual TLS (client-ca.pem) needs TLS: server.pem and server.key in $access_dir"
if has server.pem || has server.key; then
    has server.pem && has server.key || die "TLS needs both server.pem and server.key in $access_dir"
    set -- "$@" "--grpc-server-cert=$access_dir/server.pem" "--grpc-server-key=$access_dir/server.key"
    if has client-ca.pem; then
        set -- "$@" --grpc-use-ssl-mutual=true "--grpc-root-cert=$access_dir/client-ca.pem"
        access="mutual TLS on gRPC"
    else
        set -- "$@" --grpc-use-ssl=true
        access="TLS on gRPC"
    fi
fi
inference_key=$(read_key inference.key) || exit 2
admin_key=$(read_key admin.key) || exit 2
inference_protocols=$INFERENCE_PROTOCOLS,$ADMIN_PROTOCOLS
admin="admin calls open"
[ -z "$inference_key" ] || admin="admin calls take the inference key"
if [ -n "$admin_key" ]; then
    [ "$admin_key" != "$inference_key" ] || die "admin.key must differ from inference.key"
    restricted="$ADMIN_PROTOCOLS:code2wav-admin-key=$admin_key"
    set -- "$@" "--grpc-restricted-protocol=$restricted" "--http-restricted-api=$restricted"
    inference_protocols=$INFERENCE_PROTOCOLS
    admin="admin key required"
fi
if [ -n "$inference_key" ]; then
    restricted="$inference_protocols:code2wav-key=$inference_key"
    set -- "$@" "--grpc-restricted-protocol=$restricted" "--http-restricted-api=$restricted"
    access="$access, inference key required, $admin"
else
    access="$access, no inference key, $admin"
fi
echo "triton-watchdog: access: $access (from $access_dir)" >&2

"$@" &
server=$!
kill_server() {
    echo "triton-watchdog: tritonserver (pid $server) $*" >&2
    kill -KILL "$server" 2>/dev/null
    exit 0
}

(
    unanswered=0
    probed_at=$(date +%s)
    prober=
    while sleep "$interval"; do
        # The probe runs beside the health checks (one at a time), so that a hang is found as soon.
        if [ "$probe_s" -gt 0 ] && [ $(($(date +%s) - probed_at)) -ge "$probe_s" ] \
            && { [ -z "$prober" ] || ! kill -0 "$prober" 2>/dev/null; }; then
            probed_at=$(date +%s)
            (
                for model in code2wav mimi_decoder; do
                    if [ "$model" = code2wav ]; then body=$CODE2WAV_PROBE; else body=$DECODER_PROBE; fi
                    # curl's config from standard input: the key's header, kept out of curl's arguments.
                    answer=$({ [ -z "$inference_key" ] || printf 'header = "code2wav-key: %s"\n' "$inference_key"; } \
                        | curl -sS -m "$probe_timeout" -K - -H 'Content-Type: application/json' -d "$body" \
                            "$http/v2/models/$model/infer" 2>/dev/null)
                    case $answer in *"is not healthy"*) kill_server "answers, but a Python stub is dead ($answer" \
                        "from $model): killing it (SIGKILL) so that the container restarts" ;;
                    esac
                done
            ) &
            prober=$!
        fi
        [ "$checks" -gt 0 ] || continue
        curl -sS -o /dev/null -m "$timeout" "$url" 2>/dev/null
        if [ $? -eq 28 ]; then unanswered=$((unanswered + 1)); else unanswered=0; fi  # 28: curl's time-out
        [ "$unanswered" -lt "$checks" ] || kill_server "answered no health check ($url) within $timeout s," \
            "$checks times in a row: hung; killing it (SIGKILL) so that its streams move and the container restarts"
    done
) &
checker=$!

trap 'kill "$checker" 2>/dev/null; kill -TERM "$server" 2>/dev/null' TERM INT

# `wait` returns early when a trapped signal arrives; wait again until the server itself has exited.
while :; do
    wait "$server"
    code=$?
    kill -0 "$server" 2>/dev/null || break
done
kill "$checker" 2>/dev/null
exit "$code"
