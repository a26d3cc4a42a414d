"""The benchmarks of mimi-code2wav, not part of the installed package: `python -m benchmarks COMMAND`
from the repository root. Nothing is imported here, so that `gpu` runs where only its own needs are."""
