"""The prefill chunk: how many prompt tokens one vLLM engine iteration carries (``max_num_batched_tokens``).

With chunked prefill every iteration serves the running decodes first and fills the rest of its token budget
with waiting prompts, so a long prompt is prefilled a chunk per iteration and every sequence decoding beside
it waits for that chunk. A request's TPOT is the mean of its gaps, so a short answer (1-3 gaps) that shares
an iteration with a full chunk takes the whole chunk's prefill into its TPOT: at vLLM's default of 2,048
tokens that is 0.14 s on an L40S for Mistral-7B, over a 0.1 s target however many replicas run. A smaller
chunk protects TPOT and costs TTFT and prefill throughput: a prompt takes more iterations, each also a decode
step. Which side wins depends on the flavor and the request mix (on the Azure code trace's 28-token answers
an L40S serves 21% more at 768 tokens by the estimator, 74% more on the simulated engine; at 150-token
answers 2,048 is best, and slow flavors lose at any smaller chunk), so rayscale does not pick it by a rule
but asks the estimator.

``choose_chunks``: per (model, flavor), the multiple of ``CHUNK_STEP`` up to vLLM's default at which one
replica's capacity at the SLO (rayscale.core.attainment, which knows both sides) is largest, also with TPOT
``TPOT_MARGIN`` slower than profiled (a chunk that only just fits is lost to the first correction), for the
model's declared request mix (models.yaml ``request_mix``): the shape the operator expects, as NVIDIA
Dynamo's pre-deployment profiler takes the expected input and output lengths. A model without one keeps
vLLM's default; so does a profile that pins ``max_num_batched_tokens`` (a measured one: it was measured with
that engine). The chunk is fixed per deployment, since vLLM reads it once at start. ``pin_chunks`` writes the
choice into the profiles: the estimator then models what runs, the rendered serve configs pass it to vLLM
(rayscale.cluster.render), and the simulator runs each replica with it.
"""

from __future__ import annotations

from rayscale.core.attainment import CHUNK_TOKENS
from rayscale.core.catalog import Catalog, profile_key
from rayscale.core.estimate import Correction, prior_mix, replica_capacities

# Chunks are whole multiples of this (a multiple of every KV block size in use: 16 on GPU, 32 on Neuron).
CHUNK_STEP = 256
CANDIDATES = tuple(range(CHUNK_STEP, CHUNK_TOKENS + 1, CHUNK_STEP))
# A smaller chunk must beat vLLM's default by this much: the estimator's margin of error, and a deployment
# that keeps the engine's default is one fewer thing to explain.
MIN_GAIN = 0.05
# A chunk is scored by the capacity it leaves at the profile as given and at TPOT this much slower: the TPOT
# corrections the controller learns run 1.0-1.3 (simulated L40S on the Azure code trace). A chunk whose
# iteration only just fits the target (L40S: 1,024 tokens, 0.091 of 0.1 s) loses its whole gain at a
# correction of 1.1 (3.5 -> 2.0 req/s), and with it the fleet's size swings with every correction update;
# 768 keeps 2.9 at 1.3.
TPOT_MARGIN = 1.25


def choose_chunks(catalog: Catalog) -> dict[tuple[str, str], int]:
    """Per (model, flavor) of the catalog's models: the chunk rayscale deploys (module docstring)."""
    pairs = [(m, f) for m, spec in catalog.models.items() for f in spec.parallelism]
    out: dict[tuple[str, str], int] = {}
    rows = []
    for m, f in pairs:
        p = catalog.profile(m, f)
        if p.max_num_batched_tokens is not None:
            out[(m, f)] = p.max_num_batched_tokens
            continue
        if catalog.models[m].request_mix is None:
            # The generic prior is a guess for sizing, no basis for tuning an engine: vLLM's default.
            out[(m, f)] = CHUNK_TOKENS
            continue
        for c in CANDIDATES:
            if c >= p.max_num_seqs:  # vLLM's token budget holds one token of every running sequence
                rows.append(((m, f), c, p.model_copy(update={"max_num_batched_tokens": c})))
    mixes = {m: prior_mix(catalog, m) for m in catalog.models}
    n = len(rows)
    # Every row twice: as profiled, and with TPOT TPOT_MARGIN slower; a chunk scores the worse of the two.
    caps = replica_capacities([p for _, _, p in rows] * 2, [catalog.models[k[0]].slo for k, _, _ in rows] * 2,
                              [mixes[k[0]] for k, _, _ in rows] * 2,
                              [Correction()] * n + [Correction(tpot=TPOT_MARGIN)] * n,
                              target_utilization=1.0) if rows else []
    best: dict[tuple[str, str], tuple[float, int]] = {}
    default: dict[tuple[str, str], float] = {}
    for (key, c, _), cap, slow in zip(rows, caps[:n], caps[n:], strict=True):
        score = min(cap.rps, slow.rps)
        if c == CHUNK_TOKENS:
            default[key] = score
        if score > best.get(key, (0.0, 0))[0]:
            best[key] = (score, c)
    for m, f in pairs:
        if (m, f) in out:
            continue
        rps, c = best.get((m, f), (0.0, CHUNK_TOKENS))
        out[(m, f)] = c if rps > (1.0 + MIN_GAIN) * default.get((m, f), 0.0) else CHUNK_TOKENS
    return out


def pin_chunks(catalog: Catalog, tuned: bool = True, default: int = CHUNK_TOKENS) -> Catalog:
    """The catalog with the ``max_num_batched_tokens`` of every profile of its models set to the chunk its
    replicas run: ``choose_chunks`` (what rayscale deploys), or with ``tuned=False`` the profile's own else
    ``default`` (an untuned deployment: vLLM's default)."""
    chosen = choose_chunks(catalog) if tuned else {}
    profiles = dict(catalog.profiles)
    for m, spec in catalog.models.items():
        for f in spec.parallelism:
            k = profile_key(m, f)
            p = profiles[k]
            c = chosen[(m, f)] if tuned else p.max_num_batched_tokens or default
            profiles[k] = p.model_copy(update={"max_num_batched_tokens": c})
    return catalog.model_copy(update={"profiles": profiles})
