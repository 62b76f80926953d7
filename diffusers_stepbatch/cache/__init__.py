"""Caches that cut step cost without changing what a request gets: prompt embeddings and TeaCache."""

from .prompt import PromptCache, PromptCacheStats, cached_encode, encoder_namespace
from .teacache import TeaCacheConfig, TeaCacheState

__all__ = ["PromptCache", "PromptCacheStats", "TeaCacheConfig", "TeaCacheState", "cached_encode", "encoder_namespace"]
