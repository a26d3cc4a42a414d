#!/usr/bin/env bash
# perf_analyzer (2.51.0) against code2wav over gRPC streaming: one sequence per stream, steps from
# client/perf_inputs.py. Extra arguments go to perf_analyzer and choose the load, e.g. `--concurrency-range 4`
# (4 unpaced streams) or `--request-rate-range 12.5 --num-of-sequences 4 --serial-sequences` (paced).
# Variables (defaults): URL (127.0.0.1:8001), MODEL (code2wav; mimi_decoder: the decoder alone), STREAMS (8),
# FRAMES (64 per sequence), CHUNK_FRAMES (4), SCHEDULE (e.g. 1,3,1,16,2: frames per step in turn), SEED (0),
# SEQUENCE_ID_RANGE (1000000:2000000), MEASUREMENT_INTERVAL_MS (4000), STABILITY_PERCENTAGE (10), MAX_TRIALS
# (10), CSV (BUILD_DIR/perf.csv), PYTHON (.venv/bin/python), PERF_ANALYZER (next to PYTHON), BUILD_DIR (build/perf).
# TLS and keys (docs/design.md §5.3): TLS_CA, TLS_CERT + TLS_KEY (mutual TLS), KEY_FILE (else $CODE2WAV_KEY),
# ADMIN_KEY_FILE (else $CODE2WAV_ADMIN_KEY: statistics are an admin call); ACCESS_DIR supplies those not set
# from its ca.pem, client.pem + client.key, inference.key, admin.key. perf_analyzer takes the keys as -H
# arguments, which anyone who can list this host's processes can read.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
URL=${URL:-127.0.0.1:8001}
MODEL=${MODEL:-code2wav}
STREAMS=${STREAMS:-8}
FRAMES=${FRAMES:-64}
CHUNK_FRAMES=${CHUNK_FRAMES:-4}
SCHEDULE=${SCHEDULE:-}
SEED=${SEED:-0}
BUILD_DIR=${BUILD_DIR:-$ROOT/build/perf}
CSV=${CSV:-$BUILD_DIR/perf.csv}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
PERF_ANALYZER=${PERF_ANALYZER:-$(dirname "$PYTHON")/perf_analyzer}
INPUT_DATA=$BUILD_DIR/inputs-$MODEL-s$STREAMS-f$FRAMES-c$CHUNK_FRAMES-sched${SCHEDULE//,/_}-seed$SEED.json

# perf_analyzer links libb64.so.0d and libcudart.so.12; the pytriton wheel carries both, renamed.
LIB_DIR=$BUILD_DIR/lib
mkdir -p "$LIB_DIR" "$(dirname "$CSV")"
WHEEL_LIBS=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia_pytriton.libs
for pair in "libb64.so.0d:libb64-*.so.0d" "libcudart.so.12:libcudart-*.so.12*"; do
  # shellcheck disable=SC2086  # the pattern must glob
  found=$(ls $WHEEL_LIBS/${pair#*:} 2>/dev/null | head -n 1 || true)
  if [ -n "$found" ]; then ln -sfn "$found" "$LIB_DIR/${pair%%:*}"; fi
done
export LD_LIBRARY_PATH=$LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

cd "$ROOT"
SEQUENCE_LENGTH=$("$PYTHON" -m client.perf_inputs --out "$INPUT_DATA" --model "$MODEL" --streams "$STREAMS" \
  --frames "$FRAMES" --chunk-frames "$CHUNK_FRAMES" ${SCHEDULE:+--schedule "$SCHEDULE"} --seed "$SEED" \
  | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["steps_per_sequence"])')
COMPOSING=()  # code2wav's statistics include its composing model
if [ "$MODEL" = code2wav ]; then COMPOSING=(--bls-composing-models=mimi_decoder); fi

for pair in TLS_CA:ca.pem KEY_FILE:inference.key ADMIN_KEY_FILE:admin.key; do
  var=${pair%%:*} file=${ACCESS_DIR:-}/${pair#*:}  # each variable not set, from its file in ACCESS_DIR
  if [ -n "${ACCESS_DIR:-}" ] && [ -z "${!var:-}" ] && [ -f "$file" ]; then printf -v "$var" %s "$file"; fi
done
# The client certificate and its key come from ACCESS_DIR together, or not at all.
if [ -n "${ACCESS_DIR:-}" ] && [ -z "${TLS_CERT:-}${TLS_KEY:-}" ] && [ -f "$ACCESS_DIR/client.pem" ] && [ -f "$ACCESS_DIR/client.key" ]; then
  TLS_CERT=$ACCESS_DIR/client.pem TLS_KEY=$ACCESS_DIR/client.key
fi
ACCESS=()
if [ -n "${TLS_CA:-}" ]; then ACCESS+=(--ssl-grpc-use-ssl "--ssl-grpc-root-certifications-file=$TLS_CA"); fi
if [ -n "${TLS_CERT:-}" ]; then
  ACCESS+=("--ssl-grpc-certificate-chain-file=$TLS_CERT" "--ssl-grpc-private-key-file=${TLS_KEY:?TLS_CERT needs TLS_KEY}")
fi
read_key() {  # the key in file $1, else the variable named $2; nothing when neither is set
  if [ -n "$1" ]; then tr -d '[:space:]' < "$1"; else printf '%s' "${!2:-}"; fi
}
KEY=$(read_key "${KEY_FILE:-}" CODE2WAV_KEY)
ADMIN_KEY=$(read_key "${ADMIN_KEY_FILE:-}" CODE2WAV_ADMIN_KEY)
if [ -n "$KEY" ]; then ACCESS+=(-H "triton-grpc-protocol-code2wav-key:$KEY"); fi
if [ -n "$ADMIN_KEY" ]; then ACCESS+=(-H "triton-grpc-protocol-code2wav-admin-key:$ADMIN_KEY"); fi

exec "$PERF_ANALYZER" -m "$MODEL" -u "$URL" -i grpc --streaming "${ACCESS[@]}" --input-data "$INPUT_DATA" \
  --sequence-length "$SEQUENCE_LENGTH" --sequence-length-variation 0 \
  --sequence-id-range "${SEQUENCE_ID_RANGE:-1000000:2000000}" "${COMPOSING[@]}" \
  --measurement-interval "${MEASUREMENT_INTERVAL_MS:-4000}" \
  --stability-percentage "${STABILITY_PERCENTAGE:-10}" --max-trials "${MAX_TRIALS:-10}" -f "$CSV" "$@"
