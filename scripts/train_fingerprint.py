"""Train every head kind a few steps on a tiny random target and print a sha256 of every tensor it saved.

Run before and after a change that must not alter training; the two outputs must be identical (`diff`).
Each variant trains 6 optimizer steps of 3 micro-batches on the CPU twice: straight through, and stopped
after step 3 and resumed. Rows: the variant, the run (straight or resumed), the file and a hash of each of its
tensors (the head's weights, and the final checkpoint's optimizer moments, schedule and random state).
"""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagletree.train.config import TrainConfig  # noqa: E402
from eagletree.train.features import cache_features  # noqa: E402
from eagletree.train.loop import train  # noqa: E402
from tests.helpers import tiny_conversations, tiny_model, tiny_tokenizer  # noqa: E402

VARIANTS = {
    "eagle": {},
    "eagle-ttt2": {"ttt_steps": 2},
    "eagle-vocab30-drop": {"draft_vocab": 30, "long": "drop"},
    "eagle3": {"head_type": "eagle3"},
    "medusa": {"head_type": "medusa", "medusa_heads": 2},
    "eagle-offline": {"features_dir": "FEATURES", "feature_dtype": "fp32"},
}


def config(out: Path, variant: dict, **more) -> TrainConfig:
    base = dict(
        out_dir=str(out),
        report_to="none",
        steps=6,
        grad_accum=3,
        save_every=3,
        warmup_steps=2,
        max_len=40,
        lr=1e-3,
        device="cpu",
        precision="fp32",
    )
    values = base | variant | more
    if values.get("features_dir") == "FEATURES":
        values["features_dir"] = str(out.parent / "features")
    return TrainConfig(**values)


def tensor_hashes(path: Path) -> dict[str, str]:
    """sha256 of each tensor in a safetensors file, or of the file's bytes for any other file."""
    if path.suffix == ".safetensors":
        return {
            k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            for k, v in sorted(load_file(str(path)).items())
        }
    return {"bytes": hashlib.sha256(path.read_bytes()).hexdigest()[:16]}


def conversations(cfg: TrainConfig) -> list:
    """12 tiny chats; with long=drop every third is twice as long (past max_len), so some are dropped."""
    chats = tiny_conversations(12)
    if cfg.long == "drop":
        for chat in chats[::3]:
            chat.messages += chat.messages[:2]
    return chats


def run(cfg: TrainConfig, resume: bool = False):
    return train(
        cfg,
        resume=resume,
        model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
        conversations=conversations(cfg),
        progress=False,
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, variant in VARIANTS.items():
            root = Path(tmp) / name
            if "features_dir" in variant:
                cfg = config(root / "straight", variant)
                cache_features(
                    cfg, tiny_model("llama"), tiny_tokenizer(), tiny_conversations(12), shard_size=4, progress=False
                )
            run(config(root / "straight", variant))
            run(config(root / "resumed", variant, stop_after=3))
            run(config(root / "resumed", variant), resume=True)
            for which in ("straight", "resumed"):
                out = root / which
                files = [
                    p for p in sorted(out.rglob("*")) if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt")
                ]
                for path in files:
                    if (
                        "checkpoints" in path.parts
                        and path.parent.name != sorted((out / "checkpoints").iterdir())[-1].name
                    ):
                        continue  # earlier checkpoints differ by design between the two runs
                    rel = path.relative_to(out)
                    print(json.dumps({"variant": name, "run": which, "file": str(rel), "tensors": tensor_hashes(path)}))


if __name__ == "__main__":
    main()
