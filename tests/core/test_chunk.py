"""The prefill chunk rayscale deploys per (model, flavor): the estimator's best for the declared mix, the
profile's own where it pins one, vLLM's default otherwise; and where it ends up (estimator, serve config)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayscale.config import default_paths, load_catalog
from rayscale.core.attainment import CHUNK_TOKENS
from rayscale.core.catalog import CatalogError, RequestMixSpec
from rayscale.core.chunk import CANDIDATES, MIN_GAIN, TPOT_MARGIN, choose_chunks, pin_chunks
from rayscale.core.estimate import Correction, prior_mix, replica_capacity

CAT = load_catalog()
# The Azure code trace's shape: long prompts, short answers (28 tokens on average).
CODE = RequestMixSpec(prompt_mean=2048, output_mean=28, prompt_p95=7305)
# A chat shape: 150-token answers.
CHAT = RequestMixSpec(prompt_mean=1570, output_mean=150, prompt_p95=5200)


def _score(cat, model: str, flavor: str, chunk: int) -> float:  # type: ignore[no-untyped-def]
    """Capacity at this chunk, the worse of as profiled and with TPOT TPOT_MARGIN slower."""
    p = cat.profile(model, flavor).model_copy(update={"max_num_batched_tokens": chunk})
    return min(replica_capacity(p, cat.models[model].slo, prior_mix(cat, model), Correction(tpot=t),
                                target_utilization=1.0).rps for t in (1.0, TPOT_MARGIN))


def test_short_answers_get_a_smaller_chunk_where_it_pays_and_long_ones_keep_the_default() -> None:
    code = CAT.with_request_mix("mistral-7b", CODE).subset(["mistral-7b"])
    chosen = choose_chunks(code)
    # On the L40S a 2,048-token chunk (0.14 s) breaks a short answer's 0.1 s TPOT; a smaller one fits, with
    # room for a slower TPOT than profiled (1,024 only just fits and is not chosen).
    assert chosen[("mistral-7b", "l40s")] < 1024
    for (m, f), c in chosen.items():
        best = max(_score(code, m, f, x) for x in CANDIDATES)
        default = _score(code, m, f, CHUNK_TOKENS)
        assert _score(code, m, f, c) == pytest.approx(best if c != CHUNK_TOKENS else default)
        # The default is left only for a gain past the estimator's margin.
        assert (c != CHUNK_TOKENS) == (best > (1 + MIN_GAIN) * default)
    # Slow-prefill flavors lose more TTFT than they gain TPOT at any smaller chunk.
    assert chosen[("mistral-7b", "a10g")] == CHUNK_TOKENS
    chat = CAT.with_request_mix("mistral-7b", CHAT).subset(["mistral-7b"])
    assert choose_chunks(chat)[("mistral-7b", "l40s")] == CHUNK_TOKENS
    # Without a declared mix every flavor keeps vLLM's default: the generic prior is no basis for tuning.
    assert set(choose_chunks(CAT).values()) == {CHUNK_TOKENS}


def test_a_pinned_chunk_is_kept_and_untuned_means_the_default() -> None:
    assert CAT.profile("tiny-qwen2", "cpu").max_num_batched_tokens == 2048  # measured with it
    code = CAT.with_request_mix("mistral-7b", CODE)
    pinned = code.model_copy(update={"profiles": {
        **code.profiles, "mistral-7b/l40s": code.profile("mistral-7b", "l40s").model_copy(
            update={"max_num_batched_tokens": 1536})}})
    assert choose_chunks(pinned)[("mistral-7b", "l40s")] == 1536
    tuned = pin_chunks(code)
    assert tuned.profile("mistral-7b", "l40s").max_num_batched_tokens == choose_chunks(code)[("mistral-7b", "l40s")]
    assert pin_chunks(tuned) == tuned  # pinning twice changes nothing (the controller pins what it is given)
    untuned = pin_chunks(code, tuned=False)
    assert {p.max_num_batched_tokens for p in untuned.profiles.values()} == {CHUNK_TOKENS}
    # The estimator reads the chunk from the profile: the same catalog, two chunks, two capacities.
    slo, mix = code.models["mistral-7b"].slo, prior_mix(code, "mistral-7b")
    a = replica_capacity(tuned.profile("mistral-7b", "l40s"), slo, mix).rps
    b = replica_capacity(untuned.profile("mistral-7b", "l40s"), slo, mix).rps
    assert a > 1.05 * b


def test_a_chunk_below_max_num_seqs_is_refused_naming_the_file_and_field(tmp_path: Path) -> None:
    d = yaml.safe_load(default_paths()["profiles"].read_text())
    d["profiles"][2]["max_num_batched_tokens"] = 128  # mistral-7b/l40s runs up to 256 sequences
    path = tmp_path / "profiles.yaml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(CatalogError) as e:
        load_catalog(profiles=path)
    msg = str(e.value)
    assert "profiles.yaml" in msg and "max_num_batched_tokens (128) must be >= max_num_seqs (256)" in msg


def test_the_rendered_serve_config_passes_the_chunk_to_vllm() -> None:
    from rayscale.cluster.render import serve_config_from_catalog

    code = CAT.with_request_mix("mistral-7b", CODE)
    chosen = choose_chunks(code)
    cfg = serve_config_from_catalog(code)
    entries = {e["model_loading_config"]["model_id"]: e for e in cfg["applications"][0]["args"]["llm_configs"]}
    flavors = entries["mistral-7b"]["experimental_configs"]["rayscale"]["flavors"]
    seen = {f["flavor"]: f["engine_kwargs"]["max_num_batched_tokens"] for f in flavors}
    assert seen and all(seen[f] == chosen[("mistral-7b", f)] for f in seen)
    assert seen["l40s"] < CHUNK_TOKENS
    # Through the app's own parsing to the Ray Serve LLM config, and accepted by vLLM's engine arguments.
    from vllm.engine.arg_utils import AsyncEngineArgs

    from rayscale.engines.vllm_engine import build_llm_config
    from rayscale.serve.config import parse_app_args

    app = parse_app_args(cfg["applications"][0]["args"], "<rendered>")
    (model,) = [m for m in app.models if m.name == "mistral-7b"]
    (l40s,) = [f for f in model.flavors if f.flavor == "l40s"]
    kwargs = build_llm_config(model, l40s).engine_kwargs
    assert kwargs["max_num_batched_tokens"] == chosen[("mistral-7b", "l40s")]
    assert AsyncEngineArgs(model=model.source, max_num_batched_tokens=kwargs["max_num_batched_tokens"]) \
        .max_num_batched_tokens == chosen[("mistral-7b", "l40s")]


def test_the_controller_models_the_chunk_its_deployments_run() -> None:
    from typing import Any

    from rayscale.controller.loop import Controller

    none: Any = None
    code = CAT.with_request_mix("mistral-7b", CODE)
    ctl = Controller(code, none, none, none)  # no I/O: only what it plans with
    chosen = choose_chunks(code)
    for (m, f), c in chosen.items():
        assert ctl.catalog.profile(m, f).max_num_batched_tokens == c
    assert ctl.catalog.profile("mistral-7b", "l40s").max_num_batched_tokens < CHUNK_TOKENS
