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
# WATCHDOG_URL overrides the address checked (default http://127.0.0.1:8000/v2/health/live).
# Needs only sh, curl and sleep (the NGC tritonserver image has them); docker-compose.yml runs every
# server through it.

set -u

url=${WATCHDOG_URL:-http://127.0.0.1:8000/v2/health/live}
interval=${WATCHDOG_INTERVAL_S:-1}
timeout=${WATCHDOG_TIMEOUT_S:-2}
checks=${WATCHDOG_CHECKS:-3}
# curl's exit code for "operation timed out".
CURL_TIMED_OUT=28

if [ $# -eq 0 ]; then
    echo "usage: triton-watchdog.sh COMMAND [ARGS...]  (the tritonserver command line to watch)" >&2
    exit 2
fi
case $checks in
    '' | *[!0-9]* | 0) echo "triton-watchdog: WATCHDOG_CHECKS must be a positive integer, got '$checks'" >&2; exit 2 ;;
esac

"$@" &
server=$!

(
    unanswered=0
    while sleep "$interval"; do
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
