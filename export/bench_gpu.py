"""`python -m mimi_code2wav.export.bench_gpu`, the README's name of `python -m mimi_code2wav.server.bench.gpu`
(the step module on a CUDA GPU). Only run as a program: the export package imports nothing of the server's."""

if __name__ == "__main__":
    import sys

    from mimi_code2wav.server.bench.gpu import main

    sys.exit(main())
