#!/bin/sh
# A hung tritonserver, found and killed, so that a container's restart policy starts it again.
#
#   triton-watchdog.sh tritonserver --model-repository=/models ...
#
# Runs the command and asks its /v2/health/live every WATCHDOG_INTERVAL_S (1) seconds. A server
# that answers nothing within WATCHDOG_TIMEOUT_S (2) seconds, WATCHDOG_CHECKS (3) times in a row, is
# hung (a deadlock, a stopped process, a stalled host): it is SIGKILLed, one line says so, and this
# script exits 137. WATCHDOG_CHECKS=0 turns the health checks off. Behind the proxy its streams then move at once (a refused connection is retried
# on the next replica) instead of waiting on a server that never answers; resumable clients resume
# them there, and Docker's `restart: unless-stopped` starts the container again.
#
# Only an unanswered check counts. A refused connection (the server is still loading its models, its
# endpoints are not up yet) and any answer at all (200, or an error while it stops) reset the count.
# SIGTERM and SIGINT are passed on to the server and end the checks: the server drains within its own
# --exit-timeout-secs, and the script exits with the server's code (0 after a clean stop).
#
# A dead Python stub is found too: a code2wav stub that died (a segfault, the OOM killer) leaves the
# server answering ready while every request fails with "Stub process '...' is not healthy". Every
# WATCHDOG_PROBE_S (5) seconds the script sends code2wav and then the decoder a START+END request
# (PROBE_SEQUENCE below), waiting up to WATCHDOG_PROBE_TIMEOUT_S (10) seconds for each answer (the
# Python backend takes seconds to call a stub dead); an answer saying a stub is not healthy gets the
# server SIGKILLed the same way, for the restart policy.
# WATCHDOG_PROBE_S=0 turns it off.
#
# TLS and keys (docs/design.md §5.3) come from the folder WATCHDOG_ACCESS_DIR (default
# /run/code2wav-access, where docker-compose.yml mounts CODE2WAV_ACCESS_DIR); each file that is there
# turns on what it names, and an empty folder (or WATCHDOG_ACCESS_DIR set empty) leaves the server
# plaintext and open:
#   server.pem + server.key   TLS on gRPC (the certificate must name the host clients dial)
#   client-ca.pem             mutual TLS: clients need a certificate signed by this CA
#   inference.key             the inference key (inference, metadata, model-config calls)
#   admin.key                 the admin key (model-repository, shared-memory, statistics, trace,
#                             logging calls); without it those calls take the inference key
# The keys are appended to tritonserver's command line, which is how Triton takes them: anyone who
# can list the container's processes can read them. The stub probe sends the inference key in a
# header that curl reads from its standard input, never from its arguments.
#
# WATCHDOG_HTTP is the server's HTTP endpoint that the checks and probes ask (default http://127.0.0.1:8000).
# Needs only sh, curl, date and sleep (the NGC tritonserver image has them); docker-compose.yml runs every
# server through it.

set -u

http=${WATCHDOG_HTTP:-http://127.0.0.1:8000}
url=$http/v2/health/live
interval=${WATCHDOG_INTERVAL_S:-1}
timeout=${WATCHDOG_TIMEOUT_S:-2}
checks=${WATCHDOG_CHECKS:-3}
probe_s=${WATCHDOG_PROBE_S:-5}
probe_timeout=${WATCHDOG_PROBE_TIMEOUT_S:-10}
# The probes: code2wav's START+END without frames (its stub answers without calling the decoder) and
# one START+END step of silence for the decoder, on a sequence id no client uses.
PROBE_SEQUENCE='"parameters":{"sequence_id":18446744073709551615,"sequence_start":true,"sequence_end":true}'
CODE2WAV_PROBE="{$PROBE_SEQUENCE,\"inputs\":[{\"name\":\"input_ids\",\"shape\":[1,0],\"datatype\":\"INT64\",\"data\":[]}]}"
DECODER_PROBE="{$PROBE_SEQUENCE,\"inputs\":[{\"name\":\"codes\",\"shape\":[1,8,1],\"datatype\":\"INT32\",\"data\":[0,0,0,0,0,0,0,0]}]}"
access_dir=${WATCHDOG_ACCESS_DIR-/run/code2wav-access}
INFERENCE_PROTOCOLS=inference,metadata,model-config
ADMIN_PROTOCOLS=model-repository,shared-memory,statistics,trace,logging
# curl's exit code for "operation timed out".
CURL_TIMED_OUT=28

if [ $# -eq 0 ]; then
    echo "usage: triton-watchdog.sh COMMAND [ARGS...]  (the tritonserver command line to watch)" >&2
    exit 2
fi
case $checks in
    '' | *[!0-9]*) echo "triton-watchdog: WATCHDOG_CHECKS must be a whole number, got '$checks'" >&2; exit 2 ;;
esac
case $probe_s in
    '' | *[!0-9]*) echo "triton-watchdog: WATCHDOG_PROBE_S must be a whole number of seconds, got '$probe_s'" >&2; exit 2 ;;
esac

# A key file's one word (surrounding whitespace dropped); exits naming the file when it is not one.
read_key() {
    key=$(sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' "$1") || exit 2
    case $key in
        '' | *[[:space:],:=]*)
            echo "triton-watchdog: $1 must hold one key: not empty, without whitespace, ',', ':' or '='" >&2; exit 2 ;;
    esac
    printf '%s' "$key"
}

inference_key=
access="plaintext gRPC"
if [ -z "$access_dir" ]; then
    access_dir=/nonexistent/code2wav-access  # WATCHDOG_ACCESS_DIR set empty: no TLS, no key
fi
if [ -f "$access_dir/client-ca.pem" ] && [ ! -f "$access_dir/server.pem" ]; then
    echo "triton-watchdog: mutual TLS (client-ca.pem) needs TLS: server.pem and server.key in $access_dir" >&2
    exit 2
fi
if [ -f "$access_dir/server.pem" ] || [ -f "$access_dir/server.key" ]; then
    if [ ! -f "$access_dir/server.pem" ] || [ ! -f "$access_dir/server.key" ]; then
        echo "triton-watchdog: TLS needs both server.pem and server.key in $access_dir" >&2
        exit 2
    fi
    set -- "$@" "--grpc-server-cert=$access_dir/server.pem" "--grpc-server-key=$access_dir/server.key"
    if [ -f "$access_dir/client-ca.pem" ]; then
        set -- "$@" --grpc-use-ssl-mutual=true "--grpc-root-cert=$access_dir/client-ca.pem"
        access="mutual TLS on gRPC"
    else
        set -- "$@" --grpc-use-ssl=true
        access="TLS on gRPC"
    fi
fi
if [ -f "$access_dir/inference.key" ]; then
    inference_key=$(read_key "$access_dir/inference.key") || exit 2
fi
if [ -f "$access_dir/admin.key" ]; then
    admin_key=$(read_key "$access_dir/admin.key") || exit 2
    if [ "$admin_key" = "$inference_key" ]; then
        echo "triton-watchdog: admin.key must differ from inference.key" >&2; exit 2
    fi
    if [ -n "$inference_key" ]; then
        set -- "$@" "--grpc-restricted-protocol=$INFERENCE_PROTOCOLS:code2wav-key=$inference_key" \
            "--http-restricted-api=$INFERENCE_PROTOCOLS:code2wav-key=$inference_key"
    fi
    set -- "$@" "--grpc-restricted-protocol=$ADMIN_PROTOCOLS:code2wav-admin-key=$admin_key" \
        "--http-restricted-api=$ADMIN_PROTOCOLS:code2wav-admin-key=$admin_key"
    if [ -n "$inference_key" ]; then access="$access, inference key required"; else access="$access, no inference key"; fi
    access="$access, admin key required"
elif [ -n "$inference_key" ]; then
    set -- "$@" "--grpc-restricted-protocol=$INFERENCE_PROTOCOLS,$ADMIN_PROTOCOLS:code2wav-key=$inference_key" \
        "--http-restricted-api=$INFERENCE_PROTOCOLS,$ADMIN_PROTOCOLS:code2wav-key=$inference_key"
    access="$access, inference key required, admin calls take the inference key"
else
    access="$access, no inference key, admin calls open"
fi
echo "triton-watchdog: access: $access (from $access_dir)" >&2

"$@" &
server=$!

(
    unanswered=0
    probed_at=$(date +%s)
    prober=
    while sleep "$interval"; do
        # The probe runs beside the health checks (one at a time), so that a hung server is found as
        # soon as without it.
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
                    case $answer in
                        *"is not healthy"*)
                            echo "triton-watchdog: tritonserver (pid $server) answers, but a Python stub is dead" \
                                 "($answer from $model): killing it (SIGKILL) so that the container restarts" >&2
                            kill -KILL "$server" 2>/dev/null
                            exit 0
                            ;;
                    esac
                done
            ) &
            prober=$!
        fi
        [ "$checks" -gt 0 ] || continue
        curl -sS -o /dev/null -m "$timeout" "$url" 2>/dev/null
        if [ $? -eq $CURL_TIMED_OUT ]; then
            unanswered=$((unanswered + 1))
        else
            unanswered=0
        fi
        if [ "$unanswered" -ge "$checks" ]; then
            echo "triton-watchdog: tritonserver (pid $server) answered no health check ($url) within" \
                 "$timeout s, $checks times in a row: hung; killing it (SIGKILL) so that its streams move" \
                 "and the container restarts" >&2
            kill -KILL "$server" 2>/dev/null
            exit 0
        fi
    done
) &
checker=$!

stop() {
    kill "$checker" 2>/dev/null
    kill -TERM "$server" 2>/dev/null
}
trap stop TERM INT

# `wait` returns early when a trapped signal arrives; wait again until the server itself has exited.
while :; do
    wait "$server"
    code=$?
    kill -0 "$server" 2>/dev/null || break
done
kill "$checker" 2>/dev/null
exit "$code"
