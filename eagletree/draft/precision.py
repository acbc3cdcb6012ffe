"""The head's drafting precision, chosen by measurement: fp32 or bf16 on a CPU with native bf16.

A drafting level on a CPU reads the head's weights and its lm_head slice for a few rows: bf16 halves the bytes,
but whether that makes a level faster depends on the CPU's bf16 kernels at these shapes (and on the kernels the
drafter packs). So `--draft-dtype auto` times the drafter in both precisions the way decoding runs it (a target
pass, which evicts the head's weights from the caches, then a catch-up call and three levels) and keeps the
faster; the result is cached per CPU, thread count, torch version, target and head shape, like the kernel
choice. Drafts need not be bit-exact: the target's own pass decides every token, so output stays lossless.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

import torch

from ..files import write_json_atomic
from ..packing import kernels_tag, machine_key
from ..target import cache_dir, target_identity

CANDIDATES = (torch.float32, torch.bfloat16)
# Part of the cache key: raised when the drafters' kernels change (a choice measured on the old ones is stale).
# 2: the block head's lean call (draft/lean_block.py).
DRAFTERS_REVISION = 2


def draft_dtype_path(head, target_model) -> Path:
    """The cache file of the choice for this head's shape, target, kernels and machine."""
    vocab = head.config.draft_vocab_size or "full"
    return (
        cache_dir() / "profiles" / f"draft-dtype-{target_identity(target_model.config)['fingerprint']}-"
        f"{head.config.head_type}-{vocab}-{machine_key(target_model)}{kernels_tag(target_model)}-r{DRAFTERS_REVISION}.json"
    )


@torch.inference_mode()
def measure_draft_dtypes(head, target_model, dtypes=CANDIDATES, steps: int = 8, context: int = 256) -> dict:
    """Seconds of one drafting step (catch-up of 2 tokens, then 3 levels of 8 rows, after a one-token target pass)
    per dtype name, median over `steps` steps taken in turn for each dtype."""
    generator = torch.Generator().manual_seed(0)
    width = head.feature_spec.width  # what its catch-up reads
    vocab = target_model.get_input_embeddings().num_embeddings
    drafters = {}
    for dtype in dtypes:
        drafter = _twin(head, dtype).make_batch_drafter(target_model)
        drafter.add_row()
        drafter.extend(
            [0],
            [torch.randn(context, width, generator=generator)],
            [torch.randint(vocab, (context,), generator=generator)],
        )
        drafters[str(dtype).removeprefix("torch.")] = drafter
    device = next(target_model.parameters()).device
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    times: dict[str, list[float]] = {name: [] for name in drafters}
    for step in range(steps + 1):  # (the first step of each warms up, uncounted)
        for name, drafter in drafters.items():
            target_model(input_ids=token)
            t = time.perf_counter()
            _draft_step(drafter, width, vocab, generator, head.drafting.max_depth)
            if step:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _twin(head, dtype):
    """A copy of `head` in `dtype` from its config and weights (not `copy.deepcopy`: a drafter may have packed the
    head's Linears for oneDNN, and packed weights cannot be deep-copied)."""
    param = next(head.parameters())
    twin = type(head)(copy.deepcopy(head.config))
    twin.load_state_dict(head.state_dict())
    return twin.to(device=param.device, dtype=dtype).eval()


def _draft_step(drafter, width: int, vocab: int, generator, max_depth: int | None = None) -> None:
    """A catch-up of 2 committed tokens, then levels of 4, 8 and 8 nodes (ids 1-4 under the root, 5-12 under them
    in turn, 13-20 one under each of those), as deep as the head drafts (`max_depth` levels below the root)."""
    drafter.extend([0], [torch.randn(2, width, generator=generator)], [torch.randint(vocab, (2,), generator=generator)])
    drafter.expand([(0, torch.tensor([0]), torch.tensor([0]), torch.tensor([-1]), 1)])
    for level, nodes, parents in (
        (2, range(1, 5), [0] * 4),
        (3, range(5, 13), [1, 2, 3, 4] * 2),
        (4, range(13, 21), range(5, 13)),
    ):
        if max_depth is not None and level > max_depth:
            break
        tokens = torch.randint(vocab, (len(nodes),), generator=generator)
        drafter.expand([(0, torch.tensor(list(nodes)), tokens, torch.tensor(list(parents)), level)])


def load_or_measure_draft_dtype(head, target_model, path=None) -> torch.dtype:
    """The faster drafting precision for `head` with this target here: cached, or measured now and cached."""
    path = Path(path) if path is not None else draft_dtype_path(head, target_model)
    if path.is_file():
        try:
            chosen = json.loads(path.read_text())["chosen"]
            if chosen in {str(d).removeprefix("torch.") for d in CANDIDATES}:
                return getattr(torch, chosen)
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            pass  # a damaged cache entry is measured again and replaced
    seconds = measure_draft_dtypes(head, target_model)
    chosen = min(seconds, key=seconds.get)
    write_json_atomic(path, {"chosen": chosen, "step_seconds": seconds, "machine": machine_key(target_model)})
    return getattr(torch, chosen)
