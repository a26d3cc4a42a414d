"""`python -m mimi_code2wav.export.bench_decoder`, the README's name of `python -m mimi_code2wav.server.bench.decoder`
(the decoder alone on this machine's CPU). Only run as a program: the export package imports nothing of the server's."""

if __name__ == "__main__":
    import sys

    from mimi_code2wav.server.bench.decoder import main

    sys.exit(main())
