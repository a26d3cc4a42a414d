"""Build a TensorRT plan from an exported decoder step (run on the GPU host, e.g. in the NGC image).

One optimisation profile over batch 1..max and frames 1..max_frames_per_step covers every input, so the
plan serves any batch the Triton config allows (`max_batch_size` <= --max-batch). With --fp16 the
layers that compute RoPE angles stay in fp32 (a half-precision angle at large positions is off by
radians). TensorRT does not install on CPU-only machines: tests/test_export.py checks what it can
without it (ops TensorRT's ONNX parser supports, the profile); without trtexec this exits 3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from .spec import DecoderSpec

EXIT_NO_TENSORRT = 3


def profile_shapes(spec: DecoderSpec, max_batch: int) -> dict[str, dict[str, list[int]]]:
    """min/opt/max shapes of every input for one optimisation profile over (batch, frames): batch
    1..max_batch, frames 1..max_frames_per_step (the -1 dim of codes); opt at live streams' 1 frame."""
    opt_batch = max(1, min(max_batch, 16))

    def dims(tensor, batch: int, frames: int) -> list[int]:
        return [batch, *(frames if size == -1 else size for size in tensor.shape)]

    return {tensor.name: {"min": dims(tensor, 1, 1), "opt": dims(tensor, opt_batch, 1),
                          "max": dims(tensor, max_batch, spec.max_frames_per_step)} for tensor in spec.inputs}


def trtexec_command(trtexec: str, onnx_path: Path, plan_path: Path, spec: DecoderSpec, max_batch: int,
                    fp16: bool) -> list[str]:
    shapes = profile_shapes(spec, max_batch)

    def arg(kind: str) -> str:
        return ",".join(f"{name}:{'x'.join(map(str, dims[kind]))}" for name, dims in shapes.items())

    command = [trtexec, f"--onnx={onnx_path}", f"--saveEngine={plan_path}",
               *(f"--{kind}Shapes={arg(kind)}" for kind in ("min", "opt", "max"))]
    if fp16:
        # Everything fp16 where it is faster, except the RoPE angle computation (Cos/Sin and their inputs).
        command += ["--fp16", "--precisionConstraints=obey", f"--layerPrecisions={_rope_layer_precisions(onnx_path)}"]
    return command


def _rope_layer_precisions(onnx_path: Path) -> str:
    """trtexec --layerPrecisions pinning the RoPE angle nodes (and Cos/Sin) to fp32."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    producers = {out: node for node in model.graph.node for out in node.output}
    pinned: set[str] = set()
    frontier = [node for node in model.graph.node if node.op_type in ("Cos", "Sin")]
    while frontier:  # walk back from Cos/Sin to the position input through the angle arithmetic
        node = frontier.pop()
        if node.name in pinned or node.op_type == "Constant":
            continue
        pinned.add(node.name)
        for name in node.input:
            parent = producers.get(name)
            if parent is not None and parent.op_type in ("Mul", "Add", "Cast", "Unsqueeze", "Concat", "Sub", "Div"):
                frontier.append(parent)
    return ",".join(f"{name}:fp32" for name in sorted(pinned))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimi_code2wav.export.tensorrt_build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export-dir", type=Path, required=True, help="folder with model.onnx and manifest.json")
    parser.add_argument("--out", type=Path, help="plan path (default: <export-dir>/model.plan)")
    parser.add_argument("--max-batch", type=int, default=64, help="must be >= the config's max_batch_size")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--trtexec", default=None, help="trtexec binary (default: from PATH)")
    parser.add_argument("--print-command", action="store_true",
                        help="print the trtexec command, one argument per line (no shell re-splits it), and exit")
    args = parser.parse_args(argv)

    manifest_path = args.export_dir / "manifest.json"
    onnx_path = args.export_dir / "model.onnx"
    if not manifest_path.is_file() or not onnx_path.is_file():
        print(f"error: {args.export_dir} holds no export (run `code2wav-export build` first)", file=sys.stderr)
        return 2
    spec = DecoderSpec.from_dict(json.loads(manifest_path.read_text())["spec"])
    plan_path = args.out or args.export_dir / "model.plan"
    bundled = Path("/usr/src/tensorrt/bin/trtexec")  # the NGC image's
    trtexec = args.trtexec or shutil.which("trtexec") or (str(bundled) if bundled.is_file() else None)
    command = trtexec_command(trtexec or "trtexec", onnx_path, plan_path, spec, args.max_batch, args.fp16)
    if args.print_command:
        print("\n".join(command))
        return 0
    if trtexec is None:
        print("error: TensorRT is not available here (no trtexec on PATH or in /usr/src/tensorrt/bin). "
              "Build the plan on the GPU host, e.g. inside the NGC tritonserver image: "
              "docker compose --profile tensorrt up triton-tensorrt", file=sys.stderr)
        return EXIT_NO_TENSORRT
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    print("running:", " ".join(command), file=sys.stderr, flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
