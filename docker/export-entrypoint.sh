#!/bin/sh
# One-shot jobs of docker-compose.yml, run from the project root above this file; nothing is downloaded.
#   export           (export image) model.onnx into $EXPORT_DIR (skipped when up to date), the ONNX Runtime
#                    repository into $MODELS_DIR (KIND_GPU) and $MODELS_CPU_DIR (KIND_CPU), trtexec's lines.
#   tensorrt-plan    (NGC image, GPU) the plan, by the image's own trtexec; skipped when built from the same
#                    export, command and GPU model.
#   tensorrt-render  (export image) the TensorRT repository around that plan into $MODELS_DIR.
set -eu

cd "$(dirname "$0")/.."

# The environment (README.md "Docker Compose") with its defaults:
WEIGHTS_ROOT=${WEIGHTS_ROOT:-/weights}
MIMI_WEIGHTS=${MIMI_WEIGHTS:-}                  # in $WEIGHTS_ROOT (empty: itself)
MIMI_RANDOM_INIT=${MIMI_RANDOM_INIT:-0}
MIMI_RANDOM_SEED=${MIMI_RANDOM_SEED:-0}
EXPORT_ARGS=${EXPORT_ARGS:-}
RENDER_ARGS=${RENDER_ARGS:-}
MAX_BATCH_SIZE=${MAX_BATCH_SIZE:-64}
TENSORRT_FP16=${TENSORRT_FP16:-0}               # 1: the fp16 plan (RoPE angles kept in fp32)
TENSORRT_REBUILD=${TENSORRT_REBUILD:-0}
EXPORT_DIR=${EXPORT_DIR:-/export}
MODELS_DIR=${MODELS_DIR:-/models}
MODELS_CPU_DIR=${MODELS_CPU_DIR:-/models-cpu}
PYTHON=${PYTHON:-python}
TRTEXEC=${TRTEXEC:-/usr/src/tensorrt/bin/trtexec}  # where the NGC image has it
TENSORRT_DIR=$EXPORT_DIR/tensorrt

log() { printf 'export-entrypoint: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

if [ "$TENSORRT_FP16" = 1 ]; then precision=fp16; else precision=fp32; fi
plan=$TENSORRT_DIR/model-$precision.plan
trtexec_args=$TENSORRT_DIR/trtexec-$precision.args

export_model() {
    if [ "$MIMI_RANDOM_INIT" = 1 ]; then
        log "RANDOM weights (seed $MIMI_RANDOM_SEED): the server will decode noise"
        set -- --random-init --seed "$MIMI_RANDOM_SEED"
    else
        weights=$WEIGHTS_ROOT${MIMI_WEIGHTS:+/$MIMI_WEIGHTS}
        if [ ! -e "$weights" ] || { [ -d "$weights" ] && [ -z "$(ls -A "$weights")" ]; }; then
            die "no Mimi weights at $weights. Set MIMI_WEIGHTS_DIR to the host folder that holds them" \
                "(mounted read-only at $WEIGHTS_ROOT) and MIMI_WEIGHTS to the file or folder inside it:" \
                "a transformers folder (config.json + model.safetensors, as kyutai/mimi) or a moshi-format" \
                ".safetensors file. MIMI_RANDOM_INIT=1 exports seeded random weights (noise) instead."
        fi
        set -- --weights "$weights"
    fi
    # EXPORT_ARGS is a list of flags: split on purpose.
    # shellcheck disable=SC2086
    "$PYTHON" -m mimi_code2wav.export build "$@" --out "$EXPORT_DIR" $EXPORT_ARGS >/dev/null
}

render() {  # target, repository folder, instance kind, extra arguments...
    target=$1 out=$2 kind=$3
    shift 3
    # shellcheck disable=SC2086
    "$PYTHON" -m mimi_code2wav.export render --target "$target" --export-dir "$EXPORT_DIR" --out "$out" \
        --instance-kind "$kind" --max-batch-size "$MAX_BATCH_SIZE" "$@" $RENDER_ARGS >/dev/null
    log "$out: code2wav + mimi_decoder ($target, $kind)"
}

write_trtexec_args() {  # one argument per line, so that no shell ever re-splits them (layer names, paths)
    mkdir -p "$TENSORRT_DIR"
    for variant in fp32 fp16; do
        if [ "$variant" = fp16 ]; then set -- --fp16; else set --; fi
        "$PYTHON" -m mimi_code2wav.export.tensorrt_build --export-dir "$EXPORT_DIR" --trtexec "$TRTEXEC" \
            --out "$TENSORRT_DIR/model-$variant.plan" --max-batch "$MAX_BATCH_SIZE" --print-command "$@" \
            >"$TENSORRT_DIR/trtexec-$variant.args"
    done
    log "$TENSORRT_DIR: trtexec command lines for the tensorrt profile"
}

# What a plan depends on: the export (its manifest), the trtexec command and the GPU model.
plan_fingerprint() {
    cat "$trtexec_args" "$EXPORT_DIR/manifest.json"
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true
}

build_plan() {
    [ -f "$trtexec_args" ] || die "no $trtexec_args: the export service writes it (run it first)"
    if [ "$TENSORRT_REBUILD" != 1 ] && [ -s "$plan" ] && [ -f "$plan.stamp" ] \
        && plan_fingerprint | cmp -s - "$plan.stamp"; then
        log "$plan: up to date (TENSORRT_REBUILD=1 rebuilds it)"
        return 0
    fi
    rm -f "$plan" "$plan.stamp"
    set --
    while IFS= read -r arg; do set -- "$@" "$arg"; done <"$trtexec_args"
    [ -x "$1" ] || die "no trtexec at $1: the tensorrt-plan service runs in the NGC tritonserver image"
    log "building $plan ($precision, max batch $MAX_BATCH_SIZE); this takes minutes"
    "$@"
    [ -s "$plan" ] || die "trtexec exited 0 but wrote no $plan"
    plan_fingerprint >"$plan.stamp"
    log "$plan: built"
}

mode=${1:-export}
case $mode in
    export)
        export_model
        render onnxruntime "$MODELS_DIR" KIND_GPU
        config=$MODELS_DIR/mimi_decoder/config.pbtxt
        checked_in=$("$PYTHON" -c 'from mimi_code2wav.export.render import CHECKED_IN_CONFIG; print(CHECKED_IN_CONFIG)')
        if cmp -s "$config" "$checked_in"; then
            log "$config equals the checked-in model_repository/mimi_decoder/config.pbtxt"
        else
            log "note: $config differs from the checked-in one (EXPORT_ARGS, RENDER_ARGS or MAX_BATCH_SIZE set)"
        fi
        render onnxruntime "$MODELS_CPU_DIR" KIND_CPU
        write_trtexec_args
        ;;
    tensorrt-plan) build_plan ;;
    tensorrt-render)
        [ -s "$plan" ] || die "no plan at $plan: the tensorrt-plan service builds it (run it first)"
        render tensorrt "$MODELS_DIR" KIND_GPU --plan "$plan"
        ;;
    *) die "unknown job '$mode' (export | tensorrt-plan | tensorrt-render)" ;;
esac
