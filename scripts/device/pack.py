"""Pack what the GPU run needs into checksummed pieces under device-pieces/ (git-ignored), each small
enough to travel in one device call next to the working tree.

    .venv/bin/python scripts/device/pack.py [--distill FILE.jsonl ...] [--out device-pieces]

Pieces: the SmolLM2 GGUF file cut in two, and `payload.tar` holding the `gguf` package's files (pure
Python, with its metadata, for transformers' GGUF loader), the training data pre-tokenized with the
target's chat template (`data/sharegpt.npz`: every ShareGPT training conversation cut to max_len, with
its assistant loss mask; `data/distill.npz`: the distilled answers, if given), and MT-bench's
questions. `manifest.json` names every piece's size and sha256; it travels with each piece.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(HERE), str(REPO)]

from run import FORMAT, MANIFEST, MIB, PIECES, sha256  # noqa: E402

PIECE_LIMIT = 60 * MIB  # what one piece may weigh
CALL_LIMIT = 64 * MIB  # what one device call carries: the working tree, the manifest and one piece


def tree_bytes() -> int:
    """Bytes of the working tree a device call carries (tracked files and untracked ones git does not ignore)."""
    names = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def render_all(conversations, tok, max_len: int, what: str):
    from eagletree.train.render import RenderError, render

    records, skipped, t0 = [], 0, time.perf_counter()
    for i, conv in enumerate(conversations, start=1):
        try:
            records.append(render(tok, conv.messages, max_len))
        except RenderError:
            skipped += 1
        if i % 2000 == 0:
            print(f"  {what}: {i}/{len(conversations)} rendered ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return records, skipped


def package_files(name: str) -> list[tuple[Path, str]]:
    """(file, name in the archive) of an installed distribution's package and dist-info (transformers reads
    gguf's version from it), without caches or scripts."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"error: the package {name!r} is not installed here; install it (scripts/setup.sh does)"
        ) from None
    files = []
    for rel in dist.files or ():
        top = rel.parts[0]
        if (
            top == name or (top.startswith(f"{name}-") and top.endswith(".dist-info"))
        ) and "__pycache__" not in rel.parts:
            files.append((Path(dist.locate_file(rel)), f"site/{rel.as_posix()}"))
    if not any(arc.startswith(f"site/{name}/") for _, arc in files):
        raise SystemExit(f"error: the installed {name!r} lists no files of its package")
    return files


def pack(args) -> dict:
    """Write the pieces and manifest.json under args.out; returns the manifest."""
    import torch

    from eagletree.target import alias_path, load_target
    from eagletree.train.loop import TrainConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig.from_sources(REPO / "configs" / "smollm2-135m-eagle.yaml")
    max_len = args.max_len or cfg.max_len
    gguf = alias_path("smollm2-135m")
    _, tok = load_target("smollm2-135m", dtype=torch.float32, device="cpu")

    data = out / "data"
    data.mkdir(exist_ok=True)
    headers = pretokenize(args, cfg, tok, max_len, data)
    payload = write_payload(out / "payload.tar", data, headers)
    shutil.rmtree(data)  # the arrays live in the payload now
    parts = split_gguf(gguf, out)
    pieces = [{"name": n, "bytes": (out / n).stat().st_size, "sha256": sha256(out / n)} for n in parts + [payload.name]]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    manifest = {
        "format": FORMAT,
        "pieces": pieces,
        "payload": payload.name,
        "gguf": {"name": gguf.name, "bytes": gguf.stat().st_size, "sha256": sha256(gguf), "parts": parts},
        "data": headers,
        "commit": commit,
        "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    check_call_sizes(pieces, (out / MANIFEST).stat().st_size)
    return manifest


def pretokenize(args, cfg, tok, max_len: int, data: Path) -> dict:
    """Each source's training conversations rendered and saved as data/NAME.npz; returns each one's header."""
    from eagletree.train import pretokenized
    from eagletree.train.data import load_dataset, split

    headers = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sources = [("sharegpt", [args.dataset])] + ([("distill", args.distill)] if args.distill else [])
        for name, files in sources:
            conversations = []
            for f in files:
                train, _ = split(load_dataset(f), cfg.heldout_fraction)  # training never sees the held-out side
                conversations += train
            conversations = conversations[: args.limit] if args.limit else conversations
            records, skipped = render_all(conversations, tok, max_len, name)
            headers[name] = pretokenized.save(
                data / f"{name}.npz",
                records,
                tok,
                source=[str(f) for f in files],
                max_len=max_len,
                skipped=skipped,
                heldout_fraction=cfg.heldout_fraction,
            )
            print(
                f"{name}: {len(records)} conversations, {headers[name]['tokens']:,} tokens "
                f"({headers[name]['assistant_tokens']:,} assistant), {skipped} not renderable, "
                f"{(data / f'{name}.npz').stat().st_size / MIB:.1f} MiB",
                file=sys.stderr,
            )
    return headers


def write_payload(payload: Path, data: Path, headers: dict) -> Path:
    """payload.tar: the gguf package's files, the pre-tokenized arrays with their headers, and MT-bench."""
    from eagletree.prompts import mtbench_file

    with tarfile.open(payload, "w") as tar:
        for f, arcname in package_files("gguf"):
            tar.add(f, arcname)
        for name in headers:
            tar.add(data / f"{name}.npz", f"data/{name}.npz")
        tar.add(mtbench_file(), "data/mtbench.jsonl")
        note = json.dumps({"data": headers}, indent=2).encode()
        info = tarfile.TarInfo("data/headers.json")
        info.size = len(note)
        tar.addfile(info, io.BytesIO(note))
    return payload


def split_gguf(path: Path, out: Path) -> list[str]:
    """The GGUF file `path` cut in two halves, written to out/STEM.gguf.1 and .2; returns their names."""
    half = (path.stat().st_size + 1) // 2
    parts = []
    with open(path, "rb") as f:
        for k in (1, 2):
            part = out / f"{path.stem}.gguf.{k}"
            part.write_bytes(f.read(half))
            parts.append(part.name)
    return parts


def check_call_sizes(pieces: list[dict], manifest_bytes: int) -> None:
    """Each piece, and the device call that carries it with the working tree and the manifest, must fit the limits."""
    tree = tree_bytes()
    for p in pieces:
        call = tree + p["bytes"] + manifest_bytes
        print(
            f"piece {p['name']}: {p['bytes'] / MIB:.1f} MiB; its call carries {call / MIB:.1f} MiB with the "
            f"working tree ({tree / MIB:.1f} MiB)",
            file=sys.stderr,
        )
        if p["bytes"] > PIECE_LIMIT or call > CALL_LIMIT:
            raise SystemExit(
                f"error: piece {p['name']} is {p['bytes'] / MIB:.1f} MiB and its call "
                f"{call / MIB:.1f} MiB; expected <= {PIECE_LIMIT / MIB:.0f} and <= {CALL_LIMIT / MIB:.0f} MiB"
            )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", default=str(PIECES), help="folder for the pieces and manifest.json (default device-pieces/)"
    )
    p.add_argument("--dataset", default="sharegpt", help="ShareGPT (default) or a .json/.jsonl file of conversations")
    p.add_argument("--distill", nargs="*", default=[], help="distill JSONL files (eagletree distill) to pack too")
    p.add_argument(
        "--max-len", type=int, default=0, help="tokens kept per conversation (default: the training config's)"
    )
    p.add_argument(
        "--limit", type=int, default=0, help="pack only the first N conversations of each source (rehearsals)"
    )
    args = p.parse_args(argv)
    pack(args)
    print(f"packed into {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
