"""What a `Decoder` resolves once: the device's latency profile and the files saved next to a head.

The profile is measured once per target, device and kernels and cached on disk; each Decoder that needs it
(tree `auto`) checks the cached one with a quick probe. A head's companion files (`head.companion_file`)
are its acceptance calibration, its copy table and its datastore of earlier answers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from ..draft import target_identity
from ..errors import InvalidValue
from ..packing import kernels_tag, machine_key
from ..search import Calibrator, LatencyProfile
from ..search.copy import CopyCalibration, copy_calibration_names
from ..search.store import DATASTORE, TokenStore, vocab_fingerprint
from ..target import GQA_SDPA, cache_dir
from ..target.attention import RAGGED
from ..target.lean import lean_model
from ..verify.profile import measure_batch_verify

# A cached profile whose one-token pass is this many times slower than a fresh probe was measured
# while something else loaded the machine; it would keep `auto` from drafting where trees pay.
STALE_PROFILE = 2.0
# Tree sizes the cached profile measures. 2 and 4 are there because t(N) is not linear between 1 and 8: the
# one-token pass takes the model's causal fast path and, where `--pack auto` chose so, the stock kernels, while
# every tree pays for a mask (and the packed kernels) from N = 2 on, so a line from t(1) to t(8) underestimates
# small trees' cost and `auto` would draft two- and three-node trees that lose to plain passes.
PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)
BATCH_ROWS = (256, 2048)  # the most rows a measured batch pass has (CPU, GPU)
CALIBRATION = "calibration.json"
COMPANION_FILES = (CALIBRATION, *copy_calibration_names(False), DATASTORE)  # what decoding reads next to a head


def latency_profile(target, path=None) -> LatencyProfile:
    """The verify-latency profile of this target on this device: loaded from `path`, or from the cache.

    The cached profile (no `path`) is checked against a quick probe of the one-token pass (a fraction of a second):
    one measured while the machine was busy (t(1) more than STALE_PROFILE times the probe's) is measured again
    and replaced, and `notes` says so. A cached profile slower than the probe by less, or faster (this run is
    the busy one), is kept; one measured at other sizes than PROFILE_SIZES (an older version's) is measured
    again. A `Decoder` resolves its profile once; build one Decoder for many prompts.
    """
    device = next(target.parameters()).device

    def measure(sizes=PROFILE_SIZES, reps=3):
        seconds = measure_passes(target, sizes, reps)
        return LatencyProfile(list(sizes), seconds, device=device.type, model=target.config.model_type)

    if path is not None:  # a profile measured elsewhere (e.g. on a serving GPU) is taken as it is
        return LatencyProfile.load_or_measure(path, measure)
    return _checked_profile(profile_path(target), measure)


def measure_passes(target, sizes, reps: int) -> list[float]:
    """Seconds of one sequence's verify step (the pass, greedy acceptance, commit) per tree size of `sizes`, after
    128 cached tokens: the ragged passes the decoding loop runs (`verify.batch.verify_rows`; the lean path where the
    target has one), not transformers' own tree pass, whose costs differ in level and in shape (measured on a
    2-core EPYC: t(1) 19.4 against 16.7 ms, t(16)/t(1) 1.57 against 1.71)."""
    return measure_batch_verify(target, 1, sizes, prefix=128, reps=reps)


def profile_path(target) -> Path:
    """Where the cached latency profile of this target, device and kernels lives."""
    device = next(target.parameters()).device
    name = f"{target_identity(target.config)['fingerprint']}-{device.type}-{machine_key(target)}"
    name += kernels_tag(target)  # other kernels, other costs
    if _reads_grouped_heads_in_place(target.config, device):
        name += "-gqa"
    if lean_model(target) is not None:  # passes through the lean path (target/lean.py) cost less
        name += "-lean"
    name += "-ragged"  # (one sequence's passes measured as the decoding loop runs them: `measure_passes`)
    return cache_dir() / "profiles" / f"{name}.json"


def _reads_grouped_heads_in_place(config, device) -> bool:
    """Whether tree passes read grouped key/value heads in place (GQA_SDPA; RAGGED on a CPU does too)."""
    impl = config._attn_implementation
    groups = config.num_attention_heads // max(getattr(config, "num_key_value_heads", None) or 1, 1)
    return impl == GQA_SDPA or (impl == RAGGED and device.type == "cpu" and groups > 1)


def batch_sizes_to_measure(batch: int) -> list[int]:
    """The batch sizes a profile needs for decoding `batch` sequences at a time (their number shrinks as the
    last ones finish): the powers of two up to it, and it."""
    sizes = [b for b in (2, 4, 8, 16, 32, 64) if b < batch]
    return sizes + [batch] if batch > 1 else []


def add_batch_times(target, profile: LatencyProfile, batch: int, path=None) -> LatencyProfile:
    """`profile` with passes of 2.. `batch` sequences measured where it has none (tree sizes up to BATCH_ROWS
    rows a pass); saved to `path` (the cached profile's file) when given."""
    missing = [b for b in batch_sizes_to_measure(batch) if not profile.has_batch(b)]
    if not missing:
        return profile
    limit = BATCH_ROWS[next(target.parameters()).device.type == "cuda"]
    for b in missing:
        sizes = [n for n in profile.sizes if b * n <= limit] or profile.sizes[:1]
        profile.batch_verify_s[str(b)] = measure_batch_verify(target, b, sizes)
    if path is not None:
        profile.save(path)
    return profile


def _checked_profile(path, measure) -> LatencyProfile:
    """The cached profile at `path` if a probe of the one-token pass says it was not measured on a busy machine,
    else (or when there is none, or it is damaged) a new measurement saved there."""
    try:
        cached = LatencyProfile.load(path) if path.is_file() else None
    except ValueError:  # a damaged cache file is measured again
        cached = None
    if cached is not None and tuple(cached.sizes) != PROFILE_SIZES:
        cached = None
    if cached is not None:
        probe = float(measure(sizes=(1,), reps=2).verify(1))
        if float(cached.verify(1)) <= STALE_PROFILE * probe:
            return cached
        stale = float(cached.verify(1))
    profile = measure()
    if cached is not None:
        profile.notes["remeasured"] = (
            f"the cached profile's one-token pass took {stale * 1e3:.1f} ms, a probe now "
            f"{probe * 1e3:.1f} ms: it was measured on a busy machine"
        )
    profile.save(path)
    return profile


def head_calibrator(head):
    """The calibration saved next to a head (`calibration.json`, written by its evaluation), if any."""
    path = head.companion_file(CALIBRATION)
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "method" not in data:
            raise InvalidValue(f"expected a JSON object with a method, got {json.dumps(data)[:60]}")
        calibrator = Calibrator(**{k: data[k] for k in ("method", "xs", "ys", "scale", "bias") if k in data})
        calibrator.check()
    except (OSError, ValueError, TypeError) as e:
        raise InvalidValue(
            f"{path} is not a valid calibration ({e}); remove it to decode with the head's raw "
            f"probabilities, or write it again with `python -m eagletree.train.evaluate`"
        ) from None
    return calibrator


def head_copy_calibration(head, copy_len: int = 16) -> CopyCalibration:
    """The copy calibration saved next to a head for the vocabulary it drafts over now (`copy_calibration.json`, or
    `copy_calibration.full-vocab.json` for a widened head), else the other one, else an uninformed one (0.5)."""
    for name in copy_calibration_names(head.is_widened()) if head is not None else ():
        path = head.companion_file(name)
        if path is not None:
            return CopyCalibration.load(path)  # its last column values the positions past its length
    return CopyCalibration(max_len=copy_len)


def resolve_store(store, head, tokenizer, copy: bool, vocab_size: int | None = None) -> TokenStore | None:
    """A decoding's datastore: "auto" = the head folder's datastore.npz when copying (None without one, or, with a
    warning, when it does not suit this target or cannot be read), None = none, a TokenStore, or a datastore
    file's path (an error when it does not suit)."""
    if store is None or (store == "auto" and not copy):
        return None
    if not copy:
        raise InvalidValue(
            "store adds retrieved spans to the copied ones, so it needs copying on (copy=True, or the "
            "default copy=None with an eagle2, optimal or auto tree); copying is off here"
        )
    if isinstance(store, TokenStore):
        return store
    auto = store == "auto"
    if auto:
        store = head.companion_file(DATASTORE) if head is not None else None
        if store is None:
            return None
    if not isinstance(store, (str, Path)):
        raise InvalidValue(f"store must be 'auto', None, a TokenStore or a datastore file's path, got {store!r}")
    try:
        return TokenStore.load(
            Path(store).resolve(), None if tokenizer is None else vocab_fingerprint(tokenizer), vocab_size
        )[0]
    except ValueError as e:
        if not auto:
            raise
        warnings.warn(f"the head's {DATASTORE} is not used: {e}")
        return None
