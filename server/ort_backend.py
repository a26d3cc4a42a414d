"""Triton's native ONNX Runtime backend beside the pip tritonserver's Python backend (docs/design.md §4):
`libtriton_onnxruntime.so` (built for 2.51, CPU) from the folder ORT_BACKEND names, and ONNX Runtime 1.19.2's
library (what 2.51 builds against) from PyPI's wheel, pinned by sha256 (`python -m
mimi_code2wav.server.ort_backend` fetches it ahead of time, as `make venv` does)."""

from __future__ import annotations

import filecmp
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

from .processes import ServerError, report

ORT_BACKEND_ENV = "ORT_BACKEND"
BACKEND_LIBRARY = "libtriton_onnxruntime.so"
ORT_LIBRARY = "libonnxruntime.so.1"  # its SONAME; the backend's RUNPATH is $ORIGIN
ORT_VERSION = "1.19.2"
ORT_LIBRARY_MEMBER = f"onnxruntime/capi/libonnxruntime.so.{ORT_VERSION}"
ORT_LIBRARY_SHA256 = "4ff01702cba83d4162e87752deb6f09a8bb9297185880e2b54067ef3ffb334f1"  # in the cp311 x86-64 wheel


def install_file(source: Path, target: Path, mode: int) -> None:
    """Copy `source` to `target` unless an identical file is there; atomic, so concurrent callers
    and running servers (which keep the old inode mapped) never see a half-written file."""
    if target.exists() and filecmp.cmp(source, target, shallow=False):
        return
    partial = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    shutil.copyfile(source, partial)
    os.chmod(partial, mode)
    os.replace(partial, target)


def backend_source() -> Path:
    """The folder of Triton's ONNX Runtime backend: ORT_BACKEND, else shared/ beside this checkout."""
    default = Path(__file__).resolve().parent.parent.parent / "shared" / "triton-onnxruntime-backend"
    return Path(os.environ.get(ORT_BACKEND_ENV) or default)


def needs_onnxruntime(repository: Path) -> bool:
    """True when a model of `repository` is served by the native `onnxruntime` backend."""
    return any(re.search(r'^\s*backend:\s*"onnxruntime"', config.read_text(), re.MULTILINE)
               for config in Path(repository).glob("*/config.pbtxt"))


def fetch_onnxruntime_library() -> Path:
    """ONNX Runtime 1.19.2's shared library in this environment, downloaded from PyPI once, sha256-checked."""
    target = Path(sys.prefix) / "share" / "mimi-code2wav" / f"onnxruntime-{ORT_VERSION}" / ORT_LIBRARY
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == ORT_LIBRARY_SHA256:
        return target
    print(f"fetching ONNX Runtime {ORT_VERSION}'s library for the native backend (pip download, 13 MB) ...",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="onnxruntime-wheel-") as folder:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                   "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                   "--platform", "manylinux_2_28_x86_64", "--dest", folder, f"onnxruntime=={ORT_VERSION}"]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(folder).glob("onnxruntime-*.whl"))
        if done.returncode != 0 or not wheels:
            raise ServerError(f"could not download onnxruntime=={ORT_VERSION} for the native backend: "
                              f"{((done.stderr or done.stdout).strip().splitlines() or ['no wheel'])[-1]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            library = Path(wheel.extract(ORT_LIBRARY_MEMBER, folder))
        if hashlib.sha256(library.read_bytes()).hexdigest() != ORT_LIBRARY_SHA256:
            raise ServerError(f"{ORT_LIBRARY_MEMBER} of the downloaded onnxruntime=={ORT_VERSION} wheel does not have "
                              f"the pinned sha256 {ORT_LIBRARY_SHA256}")
        target.parent.mkdir(parents=True, exist_ok=True)
        install_file(library, target, 0o755)
    return target


def install_onnxruntime_backend(backend_dir: Path) -> Path:
    """`backend_dir/onnxruntime/` with the backend and ONNX Runtime's library; refuses in one line when
    ORT_BACKEND holds no backend."""
    source = backend_source() / BACKEND_LIBRARY
    if not source.is_file():
        raise ServerError(f"the onnxruntime decoder needs Triton's ONNX Runtime backend, and {source} does not "
                          f"exist: set {ORT_BACKEND_ENV}=<folder holding {BACKEND_LIBRARY}> (built for tritonserver "
                          "2.51), or serve the repository in the NGC image nvcr.io/nvidia/tritonserver:24.10-py3, "
                          "which carries it")
    folder = Path(backend_dir) / "onnxruntime"
    folder.mkdir(parents=True, exist_ok=True)
    install_file(source, folder / BACKEND_LIBRARY, 0o755)
    install_file(fetch_onnxruntime_library(), folder / ORT_LIBRARY, 0o755)
    return folder


if __name__ == "__main__":
    try:
        print(fetch_onnxruntime_library())
    except ServerError as error:
        sys.exit(report(error))
