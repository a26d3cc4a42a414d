"""The serving flags of a rendered model repository, declared once for `code2wav-export render` and
`python -m benchmarks sweep`, and the `render.DecoderServing` they build."""

from __future__ import annotations

import argparse

from .render import PYTHON_TARGETS, DecoderServing


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"an integer >= 1, got {text!r}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"an integer >= 0, got {text!r}")
    return int(text)


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """The decoder's and code2wav's serving knobs (instances, batching, stream capacity)."""
    group = parser.add_argument_group("serving (the rendered configs)")
    group.add_argument("--instance-kind", choices=("KIND_GPU", "KIND_CPU"),
                       help="the decoder's instances (default: KIND_CPU for the Python decoders, else KIND_GPU)")
    group.add_argument("--instance-count", type=positive_int, default=DecoderServing.instance_count,
                       help="decoder instances (default %(default)s)")
    group.add_argument("--max-batch-size", type=positive_int, default=DecoderServing.max_batch_size,
                       help="the decoder's largest batch (default %(default)s)")
    group.add_argument("--max-queue-delay-us", type=non_negative_int, default=DecoderServing.max_queue_delay_us,
                       help="how long the decoder's batcher waits for more streams' steps (default %(default)s): "
                       "0 cuts a lone request's latency by up to that much, at the cost of smaller batches under load")
    group.add_argument("--max-live-streams", type=positive_int, default=DecoderServing.max_candidate_sequences,
                       help="live streams the decoder holds (its max_candidate_sequences; code2wav's max_live_streams; "
                       "the GPU memory pools are sized for it) (default %(default)s)")
    group.add_argument("--front-instances", type=positive_int, default=DecoderServing.front_instances,
                       help="code2wav model instances (Python processes; the streams are shared out among them): "
                       "one carries a few thousand requests/s, more use more cores (default %(default)s)")
    group.add_argument("--intra-op-threads", type=non_negative_int, default=DecoderServing.intra_op_threads,
                       help="ONNX Runtime threads per decoder instance (python-ort, onnxruntime); 0: one per core "
                       "(default %(default)s)")
    group.add_argument("--front-queue-delay-us", type=non_negative_int, default=DecoderServing.front_queue_delay_us,
                       help="how long code2wav's batcher waits for more streams' requests (default %(default)s)")


def serving_from_args(args: argparse.Namespace, target: str) -> DecoderServing:
    """The `DecoderServing` the flags of `add_serving_arguments` ask for, for a decoder `target`."""
    kind = args.instance_kind or ("KIND_CPU" if target in PYTHON_TARGETS else "KIND_GPU")
    return DecoderServing(
        instance_kind=kind, instance_count=args.instance_count, max_batch_size=args.max_batch_size,
        max_candidate_sequences=args.max_live_streams, max_queue_delay_us=args.max_queue_delay_us,
        front_instances=args.front_instances, front_queue_delay_us=args.front_queue_delay_us,
        intra_op_threads=args.intra_op_threads,
        preferred_batch_sizes=[s for s in DecoderServing().preferred_batch_sizes if s <= args.max_batch_size],
    )
