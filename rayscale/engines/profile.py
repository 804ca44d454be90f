"""Performance profile of one (model, flavor), as the emulated engine consumes it.

The decision core owns the canonical model (``rayscale.core.catalog.Profile``); the engine only needs
the fields below, so it accepts anything with these attributes (``ProfileLike``), and configs use
``EmulatedProfile`` which has the same field names.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


@runtime_checkable
class ProfileLike(Protocol):
    model: str
    flavor: str
    prefill_tokens_per_s: float
    overhead_s: float
    itl_alpha_s: float
    itl_beta_s: float
    max_num_seqs: int
    kv_tokens: int
    startup_s: float
    source: str


class EmulatedProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = ""
    flavor: str = ""
    prefill_tokens_per_s: float = Field(gt=0)
    overhead_s: float = Field(ge=0)
    itl_alpha_s: float = Field(ge=0)
    itl_beta_s: float = Field(ge=0)
    max_num_seqs: int = Field(ge=1)
    kv_tokens: int = Field(ge=1)
    startup_s: float = Field(default=0.0, ge=0)
    source: str = ""

    @classmethod
    def from_profile(cls, p: Any) -> EmulatedProfile:
        """Copy any ProfileLike (e.g. the core catalog's Profile) into this model."""
        if isinstance(p, EmulatedProfile):
            return p
        if isinstance(p, dict):
            return cls.model_validate(p)
        return cls.model_validate({k: getattr(p, k) for k in cls.model_fields if hasattr(p, k)})


# Mistral-7B on one A10G (g5.xlarge), fitted to the published llmperf numbers in FACTS.md
# (Llama-3-8B, vLLM 0.4.3, 550 prompt / 150 output tokens):
#   ITL 30.7 ms at concurrency 1, 33.9 at 4, 42.7 at 16 -> alpha ~29.9 ms, beta ~0.8 ms per running seq;
#   TTFT 137 ms at concurrency 1 with 550 prompt tokens -> ~30 ms overhead + 550 / ~5100 tok/s prefill.
# KV capacity: ~6.5 GB left of 24 GB at 0.9 utilisation after 14.5 GB weights, 128 KiB/token (32 layers,
# 8 KV heads x 128 dims, fp16) -> ~48k tokens; that also explains the flat 301 tok/s at concurrency 64.
MISTRAL_7B_A10G = EmulatedProfile(
    model="mistral-7b",
    flavor="a10g",
    prefill_tokens_per_s=5100.0,
    overhead_s=0.030,
    itl_alpha_s=0.0299,
    itl_beta_s=0.0008,
    max_num_seqs=256,
    kv_tokens=48_000,
    startup_s=120.0,
    source="published: llmperf A10G Llama-3-8B (FACTS.md), fitted",
)
