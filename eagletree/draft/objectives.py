"""The training objectives, one sequence at a time: EAGLE-1/2 (with the training-time test), Medusa, EAGLE-3,
block (DFlash).

Each returns (loss, parts) or None when the sequence has nothing to learn from; a head's `training_loss`
names its own. `head` is the head or the wrapper to call it through (DDP); attributes are read from the
head itself (`getattr(head, "module", head)`).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F


class LossSettings(Protocol):
    """The run's settings an objective reads (a `train.config.TrainConfig` has them; the heads sit below training,
    so they name only these)."""

    noise: float  # uniform noise on input features: U(-noise/2, noise/2)
    ttt_steps: int  # drafting steps unrolled per position; 0 = the head type's default
    ttt_decay: float  # weight of step k is ttt_decay ** (k - 1)
    l1_weight: float
    ce_weight: float


def eagle_loss(head, target_lm, embed, features, ids, mask, cfg: LossSettings, generator=None):
    """EAGLE-1/2 objective on one sequence: smooth-L1 to the next feature + w x CE to the target's distribution.

    features [T, H]: the target's post-norm features; ids [T]; mask [T] bool (assistant tokens).
    The head at position t reads (f_t + noise, x_{t+1}) and predicts f_{t+1}. With `ttt_steps` k > 1 the
    drafting steps are unrolled (the training-time test of EAGLE-3 and HASS): step k at position t reads
    step k-1's predicted f_t instead of the target's, attends as a depth-k draft node does, and is held to
    the same targets; step k's loss is weighted ttt_decay ** (k - 1). The reported l1/ce/acc are step 1's.
    """
    return eagle_batch_loss(head, target_lm, embed, [(features, ids, mask)], cfg, [generator])[0]


def eagle_batch_loss(head, target_lm, embed, batch, cfg: LossSettings, generators) -> list:
    """`eagle_loss` of each sequence of `batch` [(features, ids, mask)], right-padded into one head call per
    drafting step; sequence i's noise is drawn from `generators[i]` as it would be alone."""
    features, ids, mask, lengths = pad_rows(batch)
    f_in, f_next, tok_next = features[:, :-1], features[:, 1:], ids[:, 1:]
    m = mask[:, 1:]
    if not m.any():
        return [None] * len(batch)
    if cfg.noise:
        noise = row_noise(f_in, [n - 1 for n in lengths], generators) - 0.5
        f_in = f_in + noise * cfg.noise
    weight, bias = target_lm
    target = f_next[m]
    with torch.no_grad():
        p_target = torch.softmax(F.linear(target, weight, bias).float(), -1)
    positions = torch.arange(f_in.shape[1], device=f_in.device).expand(m.shape)
    rows = RowSums(m)
    for k, out in unroll_drafts(head, f_in, tok_next, embed, cfg.ttt_steps or 1):
        keep = (positions >= k - 1)[m]  # step k needs k-1 drafted positions before it
        if not keep.any():
            continue
        pred, goal, p_goal = out[m][keep], target[keep], p_target[keep]
        logp = torch.log_softmax(F.linear(pred, weight, bias).float(), -1)
        w = cfg.ttt_decay ** (k - 1)
        for r, sel in rows.select(keep):
            l1 = F.smooth_l1_loss(pred[sel].float(), goal[sel].float())
            ce = -(p_goal[sel] * logp[sel]).sum(-1).mean()
            rows.add(r, w, cfg.l1_weight * l1 + cfg.ce_weight * ce)
            if rows.first[r] is None:
                acc = (logp[sel].argmax(-1) == p_goal[sel].argmax(-1)).float().mean()
                rows.first[r] = {"l1": l1.detach(), "ce": ce.detach(), "acc": acc.detach(), "tokens": int(m[r].sum())}
    return rows.results()


def pad_rows(batch) -> tuple:
    """(features [B, T, W], ids [B, T], mask [B, T], lengths) of sequences [(features [T_i, W], ids, mask)],
    right-padded to the longest (zeros; the mask False): a causal head call reads each row as it would alone."""
    if len(batch) == 1:
        features, ids, mask = batch[0]
        return features[None], ids[None], mask[None], [int(ids.shape[0])]
    lengths = [int(ids.shape[0]) for _, ids, _ in batch]
    longest, (f0, i0, _) = max(lengths), batch[0]
    features = f0.new_zeros(len(batch), longest, f0.shape[-1])
    ids = i0.new_zeros(len(batch), longest)
    mask = torch.zeros(len(batch), longest, dtype=torch.bool, device=i0.device)
    for r, (f, i, mk) in enumerate(batch):
        features[r, : lengths[r]], ids[r, : lengths[r]], mask[r, : lengths[r]] = f, i, mk
    return features, ids, mask, lengths


def row_noise(ref: torch.Tensor, lengths, generators) -> torch.Tensor:
    """U(0, 1) noise like `ref` [B, t, W]: row r's first lengths[r] positions drawn from generators[r] exactly as
    the sequence alone draws them (the padding gets zeros)."""
    if ref.shape[0] == 1:
        return torch.rand(ref.shape[1:], generator=generators[0], dtype=torch.float32).to(ref)[None]
    noise = torch.zeros(ref.shape, dtype=torch.float32)
    for r, (n, g) in enumerate(zip(lengths, generators)):
        noise[r, :n] = torch.rand((n, *ref.shape[2:]), generator=g, dtype=torch.float32)
    return noise.to(ref)


class RowSums:
    """Each row's weighted loss terms of a batched objective (its entries are those of a [B, t] `mask`, in order),
    reduced per row as the row alone reduces them: results() gives [(loss, parts) or None] per row."""

    def __init__(self, mask: torch.Tensor):
        self.row_of = torch.arange(mask.shape[0], device=mask.device)[:, None].expand(mask.shape)[mask]
        self.total, self.weights = [0.0] * mask.shape[0], [0.0] * mask.shape[0]
        self.first = [None] * mask.shape[0]

    def select(self, keep: torch.Tensor):
        """(row, its entries among those `keep` [N] picks) for each row with any."""
        row_of = self.row_of[keep]
        if len(self.total) == 1:
            yield 0, slice(None)
            return
        for r in range(len(self.total)):
            sel = row_of == r
            if sel.any():
                yield r, sel

    def add(self, row: int, weight: float, term: torch.Tensor) -> None:
        self.total[row] = self.total[row] + weight * term
        self.weights[row] += weight

    def results(self) -> list:
        return [None if f is None else (t / w, f) for t, w, f in zip(self.total, self.weights, self.first)]


def medusa_loss(head, target_lm, embed, features, ids, mask, cfg: LossSettings, generator=None):
    """Medusa: head k at position t matches the target's distribution k steps later (soft labels)."""
    weight, bias = target_lm
    t_len = features.shape[0]
    k_max = getattr(head, "module", head).num_heads  # DDP wraps the head in multi-process runs
    if t_len <= k_max + 1:
        return None
    with torch.no_grad():
        p_all = torch.softmax(F.linear(features, weight, bias).float(), -1)  # [T, V'] after each position
    logits = head(features[: t_len - k_max], weight, bias).float()  # [K, T-K, V']
    total, acc, n = 0.0, 0.0, 0
    for k in range(1, k_max + 1):
        m = mask[k : t_len - k_max + k]
        if not m.any():
            continue
        target = p_all[k : t_len - k_max + k][m]
        logp = torch.log_softmax(logits[k - 1][m], -1)
        total = total + (-(target * logp).sum(-1).mean()) / k_max
        acc += float((logp.argmax(-1) == target.argmax(-1)).float().mean())
        n += 1
    if n == 0:
        return None
    tokens = int(mask[1 : t_len - k_max + 1].sum())
    return total, {"l1": torch.zeros(()), "ce": total.detach(), "acc": torch.tensor(acc / n), "tokens": tokens}


def ttt_mask(t: int, k: int, device=None) -> torch.Tensor:
    """[t, k*t] bool: step k's query at position p sees step 1's keys at positions <= p-k+1 (the
    committed context) and step j's key at position p-k+j for j = 2..k (its own drafted chain),
    exactly what it sees when drafting k tokens ahead at inference."""
    p = torch.arange(t, device=device)[:, None]
    q = torch.arange(t, device=device)[None, :]
    blocks = [q <= p - k + 1] + [q == p - k + j for j in range(2, k + 1)]
    return torch.cat(blocks, dim=1)


def unroll_drafts(head, hidden, tokens, embed, steps: int):
    """Yield (k, out [B, t, H]) for drafting steps k = 1..steps over sequences hidden [B, t, H] (right-padded
    rows; one sequence [t, H] gives out [t, H]).

    Step 1 reads `hidden` (features at positions 0..t-1) with tokens x_{p+1}; step k > 1 reads step k-1's
    output at position p-1, attending under `ttt_mask`. steps == 1 is the plain causal call.
    """
    if hidden.dim() == 2:
        for k, out in unroll_drafts(head, hidden[None], tokens[None], embed, steps):
            yield k, out[0]
        return
    t = hidden.shape[1]
    positions = torch.arange(t, device=hidden.device)
    cache = getattr(head, "module", head).new_cache() if steps > 1 else None
    out = None  # step k's output, read by step k+1
    for k in range(1, steps + 1):
        if k > 1:  # step k at position p continues from step k-1's prediction at p-1
            hidden = torch.cat([out[:, :1], out[:, :-1]], dim=1)
        allowed = ttt_mask(t, k, hidden.device) if steps > 1 else None
        out = head(hidden, tokens, positions, embed, allowed=allowed, cache=cache)
        yield k, out


def eagle3_loss(head, target_lm, embed, features, ids, mask, cfg: LossSettings, generator=None):
    """EAGLE-3 training-time test: unroll `ttt_steps` drafting steps; step k reads step k-1's outputs.

    features [T, H + 3H]: the target's final hidden state and its three fused layers, concatenated.
    """
    return eagle3_batch_loss(head, target_lm, embed, [(features, ids, mask)], cfg, [generator])[0]


def eagle3_batch_loss(head, target_lm, embed, batch, cfg: LossSettings, generators) -> list:
    """`eagle3_loss` of each sequence of `batch` [(features, ids, mask)], right-padded into one head call per
    drafting step; sequence i's noise is drawn from `generators[i]` as it would be alone."""
    core = getattr(head, "module", head)
    h_size = core.config.hidden_size
    features, ids, mask, lengths = pad_rows(batch)
    final, layers = features[..., :h_size], features[..., h_size:]
    t = features.shape[1] - 1
    learns = torch.tensor([n - 1 >= 2 for n in lengths], device=mask.device)[:, None]  # (a row of 2 has nothing)
    if t < 2 or not learns.any():
        return [None] * len(batch)
    with torch.no_grad():
        weight, bias = target_lm
        p_target = torch.softmax(F.linear(final[:, 1:], weight, bias).float(), -1)  # [B, t, V'] after position p+1
    hidden = core.fuse(layers[:, :-1])  # positions p = 0..t-1, tokens x_{p+1}
    if cfg.noise:
        noise = row_noise(hidden, [n - 1 for n in lengths], generators) - 0.5
        hidden = hidden + noise * cfg.noise
    tokens, positions = ids[:, 1:], torch.arange(t, device=features.device).expand(ids.shape[0], t)
    labelled = mask[:, 1:] & learns
    rows = RowSums(labelled)
    for k, out in unroll_drafts(head, hidden, tokens, embed, cfg.ttt_steps or 3):
        valid = (positions >= k - 1) & labelled
        if not valid.any():
            continue
        logp = torch.log_softmax(core.draft_logits(out[valid]).float(), -1)
        p_goal = p_target[valid]
        w = cfg.ttt_decay ** (k - 1)
        for r, sel in rows.select(valid[labelled]):
            ce = -(p_goal[sel] * logp[sel]).sum(-1).mean()
            rows.add(r, w, ce)
            if rows.first[r] is None:
                acc = (logp[sel].argmax(-1) == p_goal[sel].argmax(-1)).float().mean()
                rows.first[r] = {"acc": acc.detach(), "tokens": int(mask[r, 1 : lengths[r]].sum())}
    return [None if res is None else _ce_only(*res) for res in rows.results()]


def _ce_only(loss, parts) -> tuple:
    """(loss, parts) of an objective that is all cross-entropy: l1 0, ce the loss."""
    return loss, {"l1": torch.zeros(()), "ce": loss.detach(), "acc": parts["acc"], "tokens": parts["tokens"]}


def block_weights(k: int, gamma: float) -> torch.Tensor:
    """[k-1] loss weights of the drafted positions 1..k-1: exp(-(j-1)/gamma) (the anchors' decay; gamma 0: the
    anchors' choice for this block size, 7 at k=16, 5 at 10, 4 at 8)."""
    gamma = gamma or {16: 7.0, 10: 5.0, 8: 4.0}.get(k, max(k / 2.0, 1.0))
    return torch.tensor([math.exp(-(j - 1) / gamma) for j in range(1, k)])


def block_anchors(mask: torch.Tensor, count: int, generator=None) -> torch.Tensor:
    """Up to `count` anchor positions [n] of one sequence, drawn without replacement (ascending): a block's root
    sits at an anchor a in [1, T-2] whose next token is an assistant token (what the block drafts first)."""
    candidates = torch.nonzero(mask[2:]).flatten() + 1  # a in [1, T-2] with mask[a + 1]
    if candidates.numel() > count:
        picked = torch.randperm(candidates.numel(), generator=generator)[:count]
        candidates = candidates[picked.to(candidates.device)].sort().values
    return candidates


def dflash_loss(head, target_lm, embed, features, ids, mask, cfg, generator=None):
    """Block drafting: blocks rooted at `cfg.block_anchors` random anchors of one sequence, all in one call; the
    block's position j (1..k-1) is held to the target's distribution of the token j past the root, weighted by
    exp(-(j-1)/gamma) (`block_gamma`), where that token is an assistant token.

    features [T, H + n_layers * H]: the target's final hidden state and the layers the head reads.
    """
    core = getattr(head, "module", head)
    h_size, k = core.config.hidden_size, core.block_size
    final, layers = features[:, :h_size], features[:, h_size:]
    anchors = block_anchors(mask, cfg.block_anchors, generator)
    if anchors.numel() == 0:
        return None
    if cfg.noise:
        noise = torch.rand(layers.shape, generator=generator, dtype=torch.float32).to(layers) - 0.5
        layers = layers + noise * cfg.noise
    t = ids.shape[0]
    where = anchors[:, None] + torch.arange(1, k, device=ids.device)  # [n, k-1]: the drafted tokens' positions
    labelled = (where < t) & mask[where.clamp(max=t - 1)]
    weight, bias = target_lm
    with torch.no_grad():  # the target's distribution of the token at p, from its final state at p - 1
        p_target = torch.softmax(F.linear(final[where[labelled] - 1], weight, bias).float(), -1)
    out = head(layers, ids, anchors, embed)[:, 1:][labelled]  # [N, H]
    logp = torch.log_softmax(F.linear(out, weight, bias).float(), -1)
    w = block_weights(k, cfg.block_gamma).to(logp.device).expand(anchors.numel(), -1)[labelled]
    ce = -(p_target * logp).sum(-1)
    loss = (w * ce).sum() / w.sum()
    first = (where == anchors[:, None] + 1)[labelled]  # the entries of position 1 (the root's child)
    hits = logp.argmax(-1) == p_target.argmax(-1)
    acc = hits[first].float().mean() if first.any() else torch.zeros(())
    return loss, {"l1": torch.zeros(()), "ce": loss.detach(), "acc": acc.detach(), "tokens": int(mask[1:].sum())}
