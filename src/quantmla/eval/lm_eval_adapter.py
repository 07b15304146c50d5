"""lm-eval's ``HFLM`` over a model loaded by quantmla, with a quantised cache (extra ``[eval]``).

Both kinds of lm-eval request see the cache as decode does:

* log-likelihoods (multiple choice, perplexity tasks) are one forward per batch; it runs under the
  decode-cache simulation (:func:`quantmla.measure.simulate.simulated_decode`), so every query attends the
  quantised latent but the ``sink`` first and ``recent`` last tokens before it, exactly as ``quantmla eval
  ppl`` scores text;
* generations (``generate_until``) run through a fresh :class:`~quantmla.cache.QuantizedLatentCache` per
  batch, so every decoded token reads the stored cache.

Latent attention is enabled on the model (in place). ``bf16`` gives the unquantised baseline through the
same code.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantmla.formats.codec import ModelCodec, scheme_name


@dataclass(frozen=True)
class LmEvalCache:
    """The cache lm-eval's requests see."""

    scheme: str | ModelCodec = "bf16"  # a scheme name, or a calibrated model's per-layer codec
    group_size: int = 64
    sink: int = 4
    recent: int = 128

    def __post_init__(self) -> None:
        scheme_name(self.scheme)  # a ValueError naming the valid schemes
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink={self.sink} and recent={self.recent} must be >= 0")


def lm_eval_model(model, tokenizer, cache: LmEvalCache, batch_size: int = 1, max_length: int | None = None):
    """An lm-eval ``LM`` (a subclass of ``HFLM``) over ``model`` whose requests read the quantised cache."""
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        raise ValueError(f"quantmla eval lm-eval needs lm-eval: pip install 'quantmla[eval]' ({e})") from None

    from quantmla.cache import QuantizedLatentCache
    from quantmla.measure.simulate import simulated_decode
    from quantmla.models.compat import cache_kwargs
    from quantmla.models.latent import enable_latent_attention, is_latent_attention_enabled

    if not is_latent_attention_enabled(model):
        enable_latent_attention(model)

    class QuantMLALM(HFLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            with simulated_decode(self.model, cache.scheme, cache.group_size, cache.sink, cache.recent):
                return super()._model_call(inps, attn_mask, labels)

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            store = QuantizedLatentCache(self.model.config, scheme=cache.scheme, group_size=cache.group_size,
                                         sink=cache.sink, recent=cache.recent)  # fmt: skip
            return super()._model_generate(context, max_length, stop, **generation_kwargs, **cache_kwargs(store))

    limit = max_length or getattr(model.config, "max_position_embeddings", None)
    return QuantMLALM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=limit,
                      device=str(next(model.parameters()).device))  # fmt: skip


def task_manager(tasks: list[str], include_path: str | None = None):
    """lm-eval's ``TaskManager`` (``include_path``: a folder of local task YAMLs, no hub) once every one of ``tasks``
    is known to it; a ``ValueError`` naming the unknown ones otherwise."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" (with {include_path})" if include_path else ""
        raise ValueError(f"lm-eval tasks {unknown} not found{where}; add --include-path DIR for local task files")
    return manager


def run_lm_eval(lm, tasks: list[str], include_path: str | None = None, limit: float | None = None,
                num_fewshot: int | None = None, seed: int = 0, manager=None) -> dict:  # fmt: skip
    """``lm_eval.simple_evaluate`` over ``lm``; ``include_path`` adds a folder of local task YAMLs (no hub);
    ``manager``: a :func:`task_manager` already checked."""
    import lm_eval

    manager = manager if manager is not None else task_manager(tasks, include_path)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                  random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                  fewshot_random_seed=seed, bootstrap_iters=1000, log_samples=False)  # fmt: skip
    return {"results": out["results"], "versions": out.get("versions", {}), "n-shot": out.get("n-shot", {})}
