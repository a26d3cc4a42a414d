"""Build a TensorRT plan from an export (on the GPU host, e.g. in the NGC image): one optimisation profile
over batch 1..--max-batch and frames 1..max_frames_per_step. With --fp16 the RoPE angle layers stay fp32
(a half-precision angle at large positions is off by radians). Without trtexec this exits 3."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from .spec import DecoderSpec

EXIT_NO_TENSORRT = 3
NGC_TRTEXEC = Path("/usr/src/tensorrt/bin/trtexec")


def profile_shapes(spec: DecoderSpec, max_batch: int) -> dict[str, dict[str, list[int]]]:
    """min/opt/max shape of every input; opt is live streams' one frame per call at batch <= 16."""
    sizes = {"min": (1, 1), "opt": (max(1, min(max_batch, 16)), 1), "max": (max_batch, spec.max_frames_per_step)}
    return {tensor.name: {kind: [batch, *(frames if size == -1 else size for size in tensor.shape)]
                          for kind, (batch, frames) in sizes.items()} for tensor in spec.inputs}


def trtexec_command(trtexec: str, onnx_path: Path, plan_path: Path, spec: DecoderSpec, max_batch: int,
                    fp16: bool) -> list[str]:
    shapes = profile_shapes(spec, max_batch)
    command = [trtexec, f"--onnx={onnx_path}", f"--saveEngine={plan_path}", *(
        f"--{kind}Shapes=" + ",".join(f"{name}:{'x'.join(map(str, dims[kind]))}" for name, dims in shapes.items())
        for kind in ("min", "opt", "max"))]
    if not fp16:
        return command
    import onnx

    # Cos/Sin and the angle arithmetic that feeds them stay fp32: walk back from them towards the position.
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    producers = {out: node for node in graph.node for out in node.output}
    pinned: set[str] = set()
    frontier = [node for node in graph.node if node.op_type in ("Cos", "Sin")]
    while frontier:
        node = frontier.pop()
        if node.name in pinned or node.op_type == "Constant":
            continue
        pinned.add(node.name)
        frontier += [producers[name] for name in node.input if name in producers and producers[name].op_type
                     in ("Mul", "Add", "Cast", "Unsqueeze", "Concat", "Sub", "Div")]
    layers = ",".join(f"{name}:fp32" for name in sorted(pinned))
    return command + ["--fp16", "--precisionConstraints=obey", f"--layerPrecisions={layers}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimi_code2wav.export.tensorrt_build", description=__doc__)
    parser.add_argument("--export-dir", type=Path, required=True, help="folder with model.onnx and manifest.json")
    parser.add_argument("--out", type=Path, help="plan path (default: <export-dir>/model.plan)")
    parser.add_argument("--max-batch", type=int, default=64, help="must be >= the config's max_batch_size")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--trtexec", help="trtexec binary (default: from PATH, else the NGC image's)")
    parser.add_argument("--print-command", action="store_true",
                        help="print the trtexec command, one argument per line (no shell re-splits it), and exit")
    args = parser.parse_args(argv)

    manifest_path, onnx_path = args.export_dir / "manifest.json", args.export_dir / "model.onnx"
    if not manifest_path.is_file() or not onnx_path.is_file():
        print(f"error: {args.export_dir} holds no export (run `code2wav-export build` first)", file=sys.stderr)
        return 2
    spec = DecoderSpec.from_dict(json.loads(manifest_path.read_text())["spec"])
    trtexec = args.trtexec or shutil.which("trtexec") or (str(NGC_TRTEXEC) if NGC_TRTEXEC.is_file() else None)
    plan_path = args.out or args.export_dir / "model.plan"
    command = trtexec_command(trtexec or "trtexec", onnx_path, plan_path, spec, args.max_batch, args.fp16)
    if args.print_command:
        print("\n".join(command))
        return 0
    if trtexec is None:
        print(f"error: TensorRT is not available here (no trtexec on PATH or in {NGC_TRTEXEC.parent}). Build the "
              "plan on the GPU host, e.g. `docker compose --profile tensorrt up triton-tensorrt`", file=sys.stderr)
        return EXIT_NO_TENSORRT
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    print("running:", " ".join(command), file=sys.stderr, flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
