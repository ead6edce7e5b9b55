"""Kernel providers: who runs a copy routine on the GPU.

``get_provider(name)`` returns a ready provider or raises ProviderError listing every provider
and, for each unavailable one, why.  See ``base.Provider`` for the protocol.
"""
from __future__ import annotations

from gpu_backend.providers.base import Provider, ProviderError
from gpu_backend.providers.builtin import BuiltinProvider
from gpu_backend.providers.sglang_kernels import SGLangProvider
from gpu_backend.providers.torch_copy import TorchProvider

PROVIDERS = {"builtin": BuiltinProvider, "torch": TorchProvider, "sglang": SGLangProvider}

__all__ = ["PROVIDERS", "Provider", "ProviderError", "get_provider", "provider_status"]


def provider_status() -> dict[str, tuple[bool, str]]:
    """name -> (available, reason) for every provider."""
    return {name: cls().available() for name, cls in PROVIDERS.items()}


def get_provider(name: str, *, require_available: bool = True) -> Provider:
    if name not in PROVIDERS:
        raise ProviderError(f"unknown provider {name!r}; expected one of {sorted(PROVIDERS)}")
    provider = PROVIDERS[name]()
    if require_available:
        ok, why = provider.available()
        if not ok:
            lines = [f"provider {name!r} is not available here: {why}", "providers:"]
            for other, (ok2, why2) in provider_status().items():
                lines.append(f"  {other}: {'available' if ok2 else 'unavailable: ' + why2}")
            raise ProviderError("\n".join(lines))
    return provider
