"""Optional dependencies: each lives in an extra of the rayscale distribution, imported where it is used."""

from __future__ import annotations


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def missing_extra(extra: str, what: str) -> MissingExtraError:
    """The error for code that needs an extra: ``raise missing_extra("kube", "the Kubernetes actuator") from e``."""
    return MissingExtraError(f"{what} needs the [{extra}] extra: pip install 'rayscale[{extra}]'")


def missing_vllm(what: str) -> MissingExtraError:
    """The error for serving code without vLLM, which comes in two builds (one extra each)."""
    return MissingExtraError(f"{what} needs vLLM: pip install 'rayscale[gpu]' (CUDA) or 'rayscale[cpu]' "
                             f"(vLLM's CPU build)")
