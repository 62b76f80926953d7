"""The steps of a dedicated program's denoising loop, walked as the pipelines' own `__call__` loops walk them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ...cache.teacache import TeaCacheState
from ..pid.exit import PiDExit


def denoising_steps(view: Any, timesteps: Any, total: int, pid: PiDExit | None = None,
                    teacache: Iterable[TeaCacheState] | None = None, current_timestep: bool = False
                    ) -> Iterator[tuple[int, Any]]:
    """(i, t) of each step the request runs, inside the pipeline's progress bar (updated after each step): up to
    PiD's early exit, none while the pipeline is interrupted; where asked, `view._current_timestep` and each
    TeaCache state's step are set first.

    >>> for i, t in denoising_steps(view, timesteps, len(timesteps), call.pid, call.teacache, current_timestep=True):
    """
    with view.progress_bar(total=total) as progress_bar:
        for i, t in enumerate(timesteps):
            if pid is not None and i == pid.exit_step:
                break  # PiD early exit: PiD decodes this x_t
            if view._interrupt:
                continue
            if current_timestep:
                view._current_timestep = t
            for state in teacache or ():
                state.step = i
            yield i, t
            progress_bar.update()
