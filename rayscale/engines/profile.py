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
    prefill_quadratic_s: float
    prefill_seq_s: float
    prefill_iteration_s: float
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
    prefill_quadratic_s: float = Field(default=0.0, ge=0)
    prefill_seq_s: float = Field(default=0.0, ge=0)
    prefill_iteration_s: float = Field(default=0.0, ge=0)
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


def catalog_profile(model: str, flavor: str) -> EmulatedProfile:
    """The shipped catalog's profile of (model, flavor): the one source of published numbers."""
    from rayscale.config import load_catalog

    return EmulatedProfile.from_profile(load_catalog().profile(model, flavor))
