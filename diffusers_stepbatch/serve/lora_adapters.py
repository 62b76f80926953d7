"""LoRA adapters a server offers by name (`--lora-modules NAME=PATH_OR_ID`, `--lora-dir DIR`), loaded with
diffusers' own `load_lora_weights`. A request picks adapters with `"lora": {"NAME": weight}`; they become its
`adapters=` (docs/guides/adapters.md), so requests with different adapters share forwards.

`--lora-modules` load at startup and stay; an adapter of `--lora-dir` loads on first use, and at most
`--max-loras` of them stay loaded (least recently used first out). Loading or unloading changes the denoiser's
layers, so it waits until no request is in flight and holds new ones back meanwhile (all on the event loop).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections import OrderedDict
from typing import Any

from .protocol import bad_request

logger = logging.getLogger(__name__)

_POLL_S = 0.01


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """`["NAME=PATH_OR_ID", ...]` -> {name: source}."""
    modules = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        if not sep or not name.strip() or not source.strip():
            raise ValueError(f"lora module {spec!r}: expected NAME=PATH_OR_ID, e.g. pixel=./loras/pixel")
        modules[name.strip()] = source.strip()
    return modules


class LoraAdapters:
    """The adapters of one served pipeline. `admit` / `release` bracket every request that may use them."""

    def __init__(self, sb: Any, modules: dict[str, str], lora_dir: str | None, max_loras: int):
        self.sb, self.lora_dir, self.max_loras = sb, lora_dir, max_loras
        self.modules = dict(modules)
        self._dynamic: OrderedDict[str, None] = OrderedDict()  # --lora-dir adapters loaded, least recent first
        self._holders = 0
        self._loading = False
        for name, source in self.modules.items():
            self._load(name, source)

    def names(self) -> list[str]:
        """Every adapter a request may name: the loaded ones and those in `--lora-dir`."""
        return sorted({*self.modules, *self._dynamic, *self._in_dir()})

    def card(self) -> dict[str, Any]:
        return {"adapters": self.names(), "loaded": sorted({*self.modules, *self._dynamic}),
                "max_loras": self.max_loras}

    def weights(self, lora: Any, param: str = "lora") -> dict[str, float]:
        """A request's `lora` field checked: {known name: finite weight >= 0}; a 400 naming what is wrong."""
        if lora is None:
            return {}
        if not isinstance(lora, dict):
            raise bad_request(f"{param} must be an object of adapter name -> weight, e.g. {{\"pixel\": 0.8}}", param)
        known = self.names()
        for name, weight in lora.items():
            if name not in known:
                raise bad_request(f"{param}: unknown adapter {name!r}; this server has {known or 'none'}", param,
                                  code="lora_not_found")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or weight < 0:
                raise bad_request(f"{param}[{name!r}]={weight!r} must be a finite number >= 0", param)
        return {name: float(weight) for name, weight in lora.items()}

    async def admit(self, names: list[str]) -> None:
        """Wait until `names` are loaded (loading missing ones while nothing runs); then count as in flight."""
        while True:
            while self._loading:
                await asyncio.sleep(_POLL_S)
            missing = [name for name in names if name not in self.modules and name not in self._dynamic]
            if not missing:
                for name in names:
                    if name in self._dynamic:
                        self._dynamic.move_to_end(name)
                self._holders += 1
                return
            self._loading = True
            try:
                while self._holders or any(self.sb.queue_lengths().values()):
                    await asyncio.sleep(_POLL_S)
                await asyncio.to_thread(self._load_missing, missing, set(names))
            finally:
                self._loading = False

    def release(self) -> None:
        self._holders -= 1

    def _load_missing(self, missing: list[str], keep: set[str]) -> None:
        for name in missing:
            self._load(name, self._source_in_dir(name))
            self._dynamic[name] = None
        while len(self._dynamic) > self.max_loras:
            evicted = next((name for name in self._dynamic if name not in keep), None)
            if evicted is None:
                break
            del self._dynamic[evicted]
            self.sb.pipe.delete_adapters(evicted)
            logger.info("LoRA %r unloaded (--max-loras %d)", evicted, self.max_loras)

    def _load(self, name: str, source: str) -> None:
        path, weight_name = source, None
        if os.path.isfile(source):  # NOTE: a single .safetensors file: its folder and file name
            path, weight_name = os.path.dirname(source) or ".", os.path.basename(source)
        self.sb.pipe.load_lora_weights(path, weight_name=weight_name, adapter_name=name)
        logger.info("LoRA %r loaded from %s", name, source)

    def _in_dir(self) -> list[str]:
        if self.lora_dir is None or not os.path.isdir(self.lora_dir):
            return []
        names = []
        for entry in os.listdir(self.lora_dir):
            stem, ext = os.path.splitext(entry)
            if ext == ".safetensors":
                names.append(stem)
            elif os.path.isdir(os.path.join(self.lora_dir, entry)):
                names.append(entry)
        return names

    def _source_in_dir(self, name: str) -> str:
        folder = os.path.join(self.lora_dir, name)
        return folder if os.path.isdir(folder) else folder + ".safetensors"
