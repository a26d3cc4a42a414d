#!/bin/sh
# A hung tritonserver, found and killed, so that a container's restart policy starts it again.
#
#   triton-watchdog.sh tritonserver --model-repository=/models ...
#
# Runs the command and asks its /v2/health/live every WATCHDOG_INTERVAL_S (1) seconds. A server
# that answers nothing within WATCHDOG_TIMEOUT_S (2) seconds, WATCHDOG_CHECKS (3) times in a row, is
# hung (a deadlock, a stopped process, a stalled host): it is SIGKILLed, one line says so, and this
# script exits 137. Behind the proxy its streams then move at once (a refused connection is retried
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
# WATCHDOG_PROBE_S (5) seconds the script sends code2wav's START+END request without frames (its stub
# answers it without decoding; sequence id 2^64 - 1, which no client uses) to WATCHDOG_PROBE_URL
# (default http://127.0.0.1:8000/v2/models/code2wav/infer), waiting up to WATCHDOG_PROBE_TIMEOUT_S (10)
# seconds for the answer (the Python backend takes seconds to call a stub dead); an answer
# saying the stub is not healthy gets the server SIGKILLed the same way, for the restart policy.
# WATCHDOG_PROBE_S=0 turns it off.
#
# WATCHDOG_URL overrides the address checked (default http://127.0.0.1:8000/v2/health/live).
# Needs only sh, curl, date and sleep (the NGC tritonserver image has them); docker-compose.yml runs every
# server through it.

set -u

url=${WATCHDOG_URL:-http://127.0.0.1:8000/v2/health/live}
interval=${WATCHDOG_INTERVAL_S:-1}
timeout=${WATCHDOG_TIMEOUT_S:-2}
checks=${WATCHDOG_CHECKS:-3}
probe_url=${WATCHDOG_PROBE_URL:-http://127.0.0.1:8000/v2/models/code2wav/infer}
probe_s=${WATCHDOG_PROBE_S:-5}
probe_timeout=${WATCHDOG_PROBE_TIMEOUT_S:-10}
PROBE='{"parameters":{"sequence_id":18446744073709551615,"sequence_start":true,"sequence_end":true},"inputs":[{"name":"input_ids","shape":[1,0],"datatype":"INT64","data":[]}]}'
# curl's exit code for "operation timed out".
CURL_TIMED_OUT=28

if [ $# -eq 0 ]; then
    echo "usage: triton-watchdog.sh COMMAND [ARGS...]  (the tritonserver command line to watch)" >&2
    exit 2
fi
case $checks in
    '' | *[!0-9]* | 0) echo "triton-watchdog: WATCHDOG_CHECKS must be a positive integer, got '$checks'" >&2; exit 2 ;;
esac
case $probe_s in
    '' | *[!0-9]*) echo "triton-watchdog: WATCHDOG_PROBE_S must be a whole number of seconds, got '$probe_s'" >&2; exit 2 ;;
esac

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
                answer=$(curl -sS -m "$probe_timeout" -H 'Content-Type: application/json' -d "$PROBE" "$probe_url" 2>/dev/null)
                case $answer in
                    *"is not healthy"*)
                        echo "triton-watchdog: tritonserver (pid $server) answers, but a Python stub is dead" \
                             "($answer from $probe_url): killing it (SIGKILL) so that the container restarts" >&2
                        kill -KILL "$server" 2>/dev/null
                        ;;
                esac
            ) &
            prober=$!
        fi
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
